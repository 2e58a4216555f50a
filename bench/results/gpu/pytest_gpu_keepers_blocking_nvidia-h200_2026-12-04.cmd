python3 -m pytest tests/test_megatron_engine.py tests/test_megatron_checkpoint.py -m gpu -q -k 'kept_shard or local_keeper or async'
