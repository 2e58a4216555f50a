# nvidia-h200-x2, 2026-11-29 23:36 UTC
source .gpu/install.sh .gpu && python3 -m bench.abort_probe --timeout 25 --out bench/results/gpu/abort_probe.json
