source .gpu/install.sh .gpu; timeout 355 python3 -m bench.scale --sizes 8 64 32 16 --repeats 2 --max-mem-gb 200 --out $OUT/scale_cpu_x2host_nvidia-h200-x2_2026-11-30h.json  # at fe84582
