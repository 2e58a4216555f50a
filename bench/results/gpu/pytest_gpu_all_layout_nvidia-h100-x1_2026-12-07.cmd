# device: nvidia-h100-x1 (NVIDIA H100 80GB HBM3), 2026-12-07, at commit f2c8993 (the layout of issue 58, plus issue 56 items 3-4)
source .gpu/install.sh .gpu
python3 -m pytest -m gpu tests/engines/test_megatron_engine.py tests/engines/test_megatron_hf.py tests/engines/test_megatron_peer_restore.py tests/rl/test_megatron_rl.py tests/data/test_sft.py tests/engines/test_context_parallel.py tests/engines/test_megatron_groups.py tests/test_config.py tests/ops/test_plan.py tests/state/test_keeper.py -q -rs -p no:cacheprovider --durations=10
# result: 15 passed, 11 skipped (need 2-8 GPUs), 132 deselected in 433.55 s
