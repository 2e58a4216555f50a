python3 -m pytest tests/test_sft.py -m gpu -q -rs -p no:cacheprovider
