# nvidia-h200-x2 host (32 cores), 2026-12-01 00:32-00:36 UTC, code 5ca8033 (N/2 logical nodes for both failure kinds)
source .gpu/install.sh .gpu; timeout 560 python3 -m bench.scale --sizes 8 64 --ranks-per-node 2 --repeats 3 --max-mem-gb 200 --out $OUT/scale_cpu_x2host_nvidia-h200-x2_2026-12-01.json
