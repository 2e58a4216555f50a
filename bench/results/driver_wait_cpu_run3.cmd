python -m bench.driver_wait --out bench/results/driver_wait_cpu_run3.json
