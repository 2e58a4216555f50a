python3 bench/first_step_probe.py --variants spare --out /root/out/first_step_probe_hostreg_nvidia-h200-x2_2026-11-30.json
