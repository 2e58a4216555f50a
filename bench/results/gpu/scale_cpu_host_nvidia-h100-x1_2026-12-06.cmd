python3 -m bench.scale --sizes 128 192 256 --nodes 4 --failures actor --max-mem-gb 110 --out bench/results/gpu/scale_cpu_host_nvidia-h100-x1_2026-12-06.json
