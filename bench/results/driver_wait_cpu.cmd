python -m bench.driver_wait
