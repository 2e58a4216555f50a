python3 -m pytest tests/test_megatron_engine.py tests/test_sft.py -m gpu -q -rs -p no:cacheprovider -k 'ce_trains or one_update_ppo or engine_one_gpu or micro_batch_split or sft'
