"""RL prompt sets in veRL's layout: a parquet or jsonl file (local, or any fsspec URL: s3://,
gs://, file://; read by `row_files`), one prompt per row, tokenized once when the run opens it.

Row layout (veRL's `RLHFDataset`, the files its `examples/data_preprocess/gsm8k.py` writes):

    prompt        a chat list [{"role": ..., "content": ...}, ...], rendered with the tokenizer's
                  chat template and the generation prompt (`add_generation_prompt=True`), or a
                  plain string, tokenized as it is (a base model's prompt: the tokenizer's own
                  special tokens, e.g. BOS, added)
    reward_model  {"ground_truth": ...}: the answer the reward compares with (any JSON value)
    data_source   optional: passed to the reward function (veRL routes rewards by it)
    extra_info    optional: passed to the reward function

The column names are `data.prompt_key` and `data.answer_key` (a dotted path into nested
columns). The chat template is applied here, once, not at every step: a step's prompt tokens
are a pure function of the file, the tokenizer and the row. Which rows a step uses is the
training data's address (`data.Data.addresses`), over prompts instead of windows.

Pad, stop and EOS ids come from the tokenizer: the stop ids are its EOS plus the
`eos_token_id`(s) of model.hf_path's generation_config.json; the pad id is its pad token, else
its EOS (prompt masks come from the prompt lengths, so a pad equal to EOS is fine).

Bad input is one `ConfigError` line naming the field: a file that cannot be read, a missing
column (naming the columns there), a prompt of the wrong type, a chat list without a chat
template, a prompt too long for train.seq_len - rl.max_new_tokens.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ftrain.config import Config, ConfigError
from ftrain.data.row_files import is_chat, read_rows


@dataclass
class PromptSet:
    """The tokenized prompts of one file, in file order, and what the reward needs of each row.

    tokens[i]: prompt token ids of row i (chat template applied); ground_truths[i],
    data_sources[i], extra_infos[i]: the row's answer, data source (or None), extra info (or
    None). tokenizer: the HF tokenizer (decodes completions); pad_id, stop_ids: see the module
    docstring."""
    path: str
    tokens: list[list[int]]
    ground_truths: list
    data_sources: list
    extra_infos: list
    tokenizer: object
    pad_id: int
    stop_ids: tuple[int, ...]
    columns: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_len(self) -> int:
        return max(map(len, self.tokens))


def _lookup(row: dict, dotted: str):
    """row[a][b]... for dotted path "a.b...", or KeyError."""
    value = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(dotted)
        value = value[part]
    return value


def _prompt_text(prompt, tok, key: str, where: str) -> tuple[str, bool]:
    """(text, add_special_tokens) of one row's prompt: a chat list rendered with the chat
    template and the generation prompt, or a plain string as it is."""
    if isinstance(prompt, str):
        return prompt, True
    if not is_chat(prompt):
        raise ConfigError(f"data.prompt_key: {key!r} of {where} is {type(prompt).__name__} "
                          f"{str(prompt)[:60]!r}, not a chat list [{{role, content}}, ...] or a string")
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"data.tokenizer: {getattr(tok, 'name_or_path', tok)} has no chat template, so the "
                          f"chat-list prompts of data.path cannot be rendered; use the chat model's own "
                          f"tokenizer, or plain-string prompts")
    messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), False


def special_ids(tok, hf_path: str | None) -> tuple[int, tuple[int, ...]]:
    """(pad id, stop ids) of tokenizer `tok` (see the module docstring). Raises ConfigError
    when there is no EOS to stop at."""
    stops = [tok.eos_token_id] if tok.eos_token_id is not None else []
    gen = Path(hf_path) / "generation_config.json" if hf_path else None
    if gen is not None and gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        stops += [i for i in (eos if isinstance(eos, list) else [eos]) if i is not None and i not in stops]
    if not stops:
        raise ConfigError(f"data.tokenizer: {getattr(tok, 'name_or_path', tok)} has no EOS token (nor does "
                          "model.hf_path's generation_config.json): generation would never stop")
    pad = tok.pad_token_id if tok.pad_token_id is not None else stops[0]
    return pad, tuple(stops)


def open_prompt_set(cfg: Config) -> PromptSet:
    """The prompt set of data.path (data.kind=prompts), tokenized with data.tokenizer (else
    model.hf_path) and checked: columns data.prompt_key and data.answer_key present in every
    row, prompts of the right type, every prompt within train.seq_len - rl.max_new_tokens
    tokens, the tokenizer within model.vocab_size. Raises ConfigError (one line)."""
    from ftrain.data.dataset import load_tokenizer

    d, t, m = cfg.data, cfg.train, cfg.model
    tok_path = d.tokenizer or m.hf_path
    if tok_path is None:
        raise ConfigError("data.tokenizer: a prompt set needs the model's tokenizer: set data.tokenizer "
                          "(a local Hugging Face tokenizer directory) or model.hf_path")
    rows = list(read_rows(d.path, "data.path"))
    if not rows:
        raise ConfigError(f"data.path: {d.path} has no rows")
    tok = load_tokenizer(tok_path)
    if len(tok) > m.vocab_size:
        raise ConfigError(f"data.tokenizer: {tok_path} has {len(tok):,} tokens, more than model.vocab_size="
                          f"{m.vocab_size:,} (the embedding rows); raise model.vocab_size or use the model's own "
                          "tokenizer")
    pad, stops = special_ids(tok, m.hf_path)
    limit = t.seq_len - cfg.rl.max_new_tokens
    out = PromptSet(d.path, [], [], [], [], tok, pad, stops, sorted({k for r in rows for k in r}))
    for n, row in enumerate(rows):
        where = f"row {n} of {d.path}"
        for key, name in ((d.prompt_key, "data.prompt_key"), (d.answer_key, "data.answer_key")):
            try:
                _lookup(row, key)
            except KeyError:
                raise ConfigError(f"{name}: {key!r} is not a column of {d.path} ({where} has: "
                                  f"{', '.join(sorted(row)) or 'nothing'}); set {name} to the column "
                                  "(a dotted path for nested columns)") from None
        text, special = _prompt_text(_lookup(row, d.prompt_key), tok, d.prompt_key, where)
        ids = tok(text, add_special_tokens=special)["input_ids"]
        if not 1 <= len(ids) <= limit:
            raise ConfigError(f"train.seq_len: the prompt of {where} is {len(ids):,} tokens; train.seq_len="
                              f"{t.seq_len} - rl.max_new_tokens={cfg.rl.max_new_tokens} leaves {limit} for a "
                              "prompt (veRL: data.max_prompt_length); raise train.seq_len or shorten the prompt"
                              if ids else f"data.prompt_key: the prompt of {where} is empty")
        out.tokens.append(ids)
        out.ground_truths.append(_lookup(row, d.answer_key))
        out.data_sources.append(row.get("data_source"))
        out.extra_infos.append(row.get("extra_info"))
    return out


def write_arithmetic_prompts(path: str, rows: int = 500, seed: int = 0, chat: bool = True) -> str:
    """A GSM8K-style prompt set for demos and tests, written in veRL's layout as parquet (or
    jsonl, by the suffix of `path`): row i asks for a + b with one-digit a, b drawn from
    `random.Random(seed)`, the answer (their sum) at reward_model.ground_truth, data_source
    "arithmetic", extra_info {"index": i}. `chat`: the prompt as a one-message chat list, else
    the plain string. The same bytes for the same arguments. Returns `path`."""
    import random

    rng = random.Random(seed)
    records = []
    for i in range(rows):
        a, b = rng.randrange(10), rng.randrange(10)
        question = f"What is {a} + {b}? Give the answer after ####.\n"
        records.append({"data_source": "arithmetic",
                        "prompt": [{"role": "user", "content": question}] if chat else question,
                        "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                        "extra_info": {"index": i}})
    out = Path(path).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), out)
    else:
        out.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(out)
