python -m bench.driver_wait (the first bench version, at be219e5: one ray.get per answer)
