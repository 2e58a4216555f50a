"""Benchmarks (`python -m bench.NAME`): each prints a table and writes its JSON with `write_json`."""
import json
import os


def write_json(path: str, result) -> None:
    """Write `result` as indented JSON to `path` (its directory made if missing)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
