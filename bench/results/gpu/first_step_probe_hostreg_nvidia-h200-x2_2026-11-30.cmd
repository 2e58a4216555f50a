python3 -m bench.first_step_probe --variants spare --out /root/out/first_step_probe_hostreg_nvidia-h200-x2_2026-11-30.json
