python3 -m pytest tests -m gpu -q -rs --durations=12 -p no:cacheprovider
