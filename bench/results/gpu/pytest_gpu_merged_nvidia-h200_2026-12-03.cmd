python3 -m pytest tests/test_megatron_engine.py tests/test_megatron_rl.py tests/test_train_speed.py tests/test_megatron_checkpoint.py -m gpu -q -rs -p no:cacheprovider
