python -m bench.driver_wait --out bench/results/driver_wait_cpu_run2.json
