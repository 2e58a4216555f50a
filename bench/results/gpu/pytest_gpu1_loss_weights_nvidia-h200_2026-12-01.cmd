python3 -m pytest tests/test_megatron_engine.py -m gpu -k 'micro_batch or dp_size' -q -rs -p no:cacheprovider
