python3 -m pytest tests/test_megatron_engine.py -m gpu -q -x
