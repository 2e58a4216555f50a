python3 -m pytest -m gpu tests/test_megatron_engine.py tests/test_megatron_hf.py tests/test_megatron_peer_restore.py tests/test_megatron_rl.py tests/test_sft.py tests/test_context_parallel.py tests/test_config.py tests/test_plan.py tests/test_keeper.py -q -rs -p no:cacheprovider --durations=10
# code under test: 44add40 (main at ad479d2); device nvidia-h100-x1 (NVIDIA H100 80GB HBM3), 2026-12-06
