python3 -m pytest tests/test_megatron_rl.py tests/test_megatron_engine.py -m gpu -q -rs --durations=12 -p no:cacheprovider
