python3 -m pytest tests/test_megatron_engine.py -m gpu -q -k engine_one_gpu
