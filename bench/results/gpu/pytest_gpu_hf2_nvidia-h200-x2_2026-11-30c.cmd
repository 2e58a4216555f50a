python3 -m pytest tests/test_megatron_hf.py::test_hf_engine_two_gpus_tp2_pp2 -m gpu -q -rs --durations=3
