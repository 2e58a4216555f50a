"""Rows of a .jsonl, .jsonl.gz or .parquet file at a local path or any fsspec URL (s3://, gs://,
file://): the documents `main.py data prepare` tokenizes and the prompts of an RL prompt set
(`prompt_set`), and the chat format of a conversation column (`is_chat`). Object storage is reached with the usual credentials and endpoint of its
client (AWS_* variables or ~/.aws for s3://, GOOGLE_APPLICATION_CREDENTIALS for gs://)."""
from __future__ import annotations

import json
from pathlib import Path

from ftrain.config import ConfigError

SUFFIXES = (".parquet", ".jsonl", ".jsonl.gz", ".json", ".json.gz")  # .json(.gz): one JSON object a line too


def read_rows(path: str, field: str):
    """Yield the rows (dicts) of `path` in file order, streamed (jsonl a line at a time, parquet
    a record batch at a time); `path` is local (`~` expanded) or an fsspec URL. Raises
    ConfigError, one line starting with `field` (the flag or config field that named the path):
    another suffix; a file that cannot be opened or read (missing, unreachable storage, no
    permission: the error's type and first line); a line that is not a JSON object; a
    .parquet file that is not parquet."""
    import fsspec

    name = path.rstrip("/").rsplit("/", 1)[-1]
    if not name.endswith(SUFFIXES):
        raise ConfigError(f"{field}: {path}: expected a .parquet, .jsonl or .jsonl.gz file")
    url = path if "://" in path else str(Path(path).expanduser())
    try:
        with fsspec.open(url, "rb", compression="gzip" if name.endswith(".gz") else None) as f:
            yield from (_parquet_rows(f) if name.endswith(".parquet") else _jsonl_rows(f, path, field))
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 (storage clients raise their own types: each is one line here)
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise ConfigError(f"{field}: cannot read {path}: {type(e).__name__}: {first}") from None


def _parquet_rows(f):
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(f).iter_batches():
        yield from batch.to_pylist()


def _jsonl_rows(f, path: str, field: str):
    for n, line in enumerate(f, 1):
        if line.strip():
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ConfigError(f"{field}: {path} line {n} is not JSON: {e}") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{field}: {path} line {n} is a {type(row).__name__}, not a JSON object")
            yield row


def is_chat(value) -> bool:
    """Whether a row's value is a conversation in the OpenAI / Hugging Face chat format: a
    non-empty list of {"role": str, "content": str} dicts (other keys allowed)."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
