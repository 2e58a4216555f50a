# nvidia-h200-x2 host (32 cores), 2026-12-01 00:52-00:57 UTC, code da3b6f9 (node losses, N/2 logical nodes: 2 ranks per node)
source .gpu/install.sh .gpu; timeout 570 python3 -m bench.scale --sizes 8 64 --ranks-per-node 2 --failures node --repeats 3 --max-mem-gb 200 --out $OUT/scale_cpu_x2host_nvidia-h200-x2_2026-12-01_node.json
