source .gpu/install.sh .gpu; python3 -m bench.scale --max-mem-gb 200 --out $OUT/scale_cpu_x2host_nvidia-h200-x2_2026-11-30f.json  # 32 host cores, CPU engine, before 59da070
