source .gpu/install.sh .gpu; python3 -m bench.scale --sizes 8 64 --repeats 3 --max-mem-gb 200 --out $OUT/scale_cpu_x2host_rerun_nvidia-h200-x2_2026-11-30f.json  # before 59da070
