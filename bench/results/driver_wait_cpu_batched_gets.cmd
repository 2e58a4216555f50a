python -m bench.driver_wait (the first bench version, after the batched gets, default GC only)
