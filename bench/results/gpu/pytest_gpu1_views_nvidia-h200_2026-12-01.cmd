python3 -m pytest tests -m gpu -q -x
