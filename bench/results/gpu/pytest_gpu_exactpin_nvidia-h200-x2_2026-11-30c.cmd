python3 -m pytest tests/test_megatron_engine.py tests/test_megatron_hf.py -m gpu -q -rs
