python3 -m pytest tests/test_megatron_engine.py tests/test_megatron_hf.py -m gpu -q -rs -x --durations=12 --deselect tests/test_megatron_engine.py::test_engine_two_gpus[local]
