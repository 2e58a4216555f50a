# nvidia-h200-x2 host (32 cores), 2026-12-01 00:46-00:51 UTC, code da3b6f9 (actor kills, 4 logical nodes)
source .gpu/install.sh .gpu; timeout 570 python3 -m bench.scale --sizes 8 16 32 64 --nodes 4 --failures actor --repeats 3 --max-mem-gb 200 --out $OUT/scale_cpu_x2host_nvidia-h200-x2_2026-12-01.json
