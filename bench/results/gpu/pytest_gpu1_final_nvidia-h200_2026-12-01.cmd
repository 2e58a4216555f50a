python3 -m pytest tests -m gpu -q -rs -p no:cacheprovider
