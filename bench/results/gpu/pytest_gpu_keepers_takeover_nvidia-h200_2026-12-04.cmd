python3 -m pytest tests/test_megatron_engine.py -m gpu -q -k 'local_keeper or kept_shard or warm_up'
