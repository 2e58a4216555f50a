python3 -m bench.host_copy --gb 2
