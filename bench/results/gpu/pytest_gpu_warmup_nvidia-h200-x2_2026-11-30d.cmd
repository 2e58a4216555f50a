timeout 230 python3 -m pytest tests/test_megatron_engine.py -m gpu -k 'warm_up or one_gpu' -q -rs
