timeout 170 python3 -m pytest tests/test_megatron_engine.py tests/test_keeper.py -m gpu -q -rs -p no:cacheprovider -k 'rollback_takes or kept_shard or local_keeper'
