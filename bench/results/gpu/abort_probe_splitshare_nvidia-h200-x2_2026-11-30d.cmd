python3 -m bench.abort_probe --cases 4,5,3 --split-share --out /root/out/gpu/abort_probe_splitshare_nvidia-h200-x2_2026-11-30d.json
