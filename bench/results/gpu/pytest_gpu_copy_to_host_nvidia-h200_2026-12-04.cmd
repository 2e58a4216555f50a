python3 -m pytest tests/test_megatron_engine.py -m gpu -q -k copy_to_host or host_copy_overlapped or kept_shard or local_keeper
