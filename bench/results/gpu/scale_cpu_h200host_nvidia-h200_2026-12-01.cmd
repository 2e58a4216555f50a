# nvidia-h200 host (16 cores), 2026-12-01 01:27-01:33 UTC, code 9ff5757 (actor kills, 4 logical nodes)
source .gpu/install.sh .gpu; timeout 380 python3 -m bench.scale --sizes 8 16 32 64 --nodes 4 --failures actor --repeats 3 --max-mem-gb 100 --out $OUT/scale_cpu_h200host_nvidia-h200_2026-12-01.json
