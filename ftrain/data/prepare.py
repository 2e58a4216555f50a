"""`main.py data {prepare,inspect,stdlib}`: make Megatron indexed datasets and look at what a
step trains on, with no Ray and no GPU.

prepare : jsonl / jsonl.gz / parquet rows (local files or s3:// / gs:// URLs: `row_files`) ->
          `{prefix}_{key}_document.bin/.idx` (the names and format Megatron-LM's
          tools/preprocess_data.py writes), tokenized with a local Hugging Face tokenizer, one
          document per row, EOD appended; written with megatron-core's
          `IndexedDatasetBuilder`, so Megatron-LM reads them too. With `--messages-key`: SFT,
          one conversation per row rendered with the chat template, and its loss mask (1 on
          assistant tokens) in a parallel uint8 dataset `{prefix}_{key}_document_loss_mask`.
inspect : `--step S` with the run's config: the datasets' windows, the step's data digest (the
          one `train` logs) and its first rows decoded.
stdlib  : an offline corpus for demos and tests: a byte-level BPE tokenizer trained on Python's
          own `pydoc_data/topics.py`, and the standard library's .py files prepared with it.
arithmetic : a GSM8K-style RL prompt set in veRL's layout (`prompt_set.write_arithmetic_prompts`).

Bad input (a missing column, an unreadable file or unreachable storage, a tokenizer that is
not a local directory, a chat template that is missing or whose assistant turns cannot be
located, a conversation over --max-len) ends with one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

from ftrain.config import ConfigError, load_config, resolve
from ftrain.data.row_files import is_chat, read_rows

SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _column(row: dict, key: str, path: str, n: int, flag: str) -> None:
    """Raise ConfigError (naming `flag`, row `n` of `path` and the row's columns) unless row has `key`."""
    if key not in row:
        raise ConfigError(f"{flag}: {key!r} is not a column of {path} (row {n} has: "
                          f"{', '.join(sorted(row)) or 'nothing'}); pass {flag} COLUMN")


def prepare(inputs: list[str], tokenizer: str, output_prefix: str, key: str = "text",
            append_eod: bool = True, batch_rows: int = 256) -> str:
    """Tokenize column `key` of every row of `inputs` (in order) into one Megatron dataset
    `{output_prefix}_{key}_document` (.bin/.idx; uint16 ids below 65,500 tokens, else int32),
    each row one document, the tokenizer's EOS appended. Returns the prefix. Raises
    ConfigError: a row without `key` (naming its keys), a non-string value, a bad file or
    tokenizer, no document at all."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    from ftrain.data.dataset import load_tokenizer

    tok = load_tokenizer(tokenizer, "--tokenizer")
    eod = tok.eos_token_id
    if append_eod and eod is None:
        raise ConfigError(f"--tokenizer: {tokenizer} has no EOS token to end documents with; pass --no-append-eod")
    prefix = f"{output_prefix}_{key}_document"
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(len(tok)))
    docs = 0

    def flush(texts):
        nonlocal docs
        for ids in tok(texts, add_special_tokens=False)["input_ids"]:
            ids = ids + [eod] if append_eod else ids
            if ids:
                builder.add_document(np.array(ids, dtype=np.int64), [len(ids)])
                docs += 1

    for path in inputs:
        texts = []
        for n, row in enumerate(read_rows(path, "--input"), 1):
            _column(row, key, path, n, "--json-keys")
            if not isinstance(row[key], str):
                raise ConfigError(f"--json-keys: {key!r} of row {n} of {path} is {type(row[key]).__name__}, not text")
            texts.append(row[key])
            if len(texts) == batch_rows:
                flush(texts)
                texts = []
        flush(texts)
    builder.finalize(prefix + ".idx")
    if not docs:
        raise ConfigError(f"--input: no documents in {', '.join(inputs)}")
    return prefix


class ChatTemplate:
    """A tokenizer's chat template (or `template`, a Jinja text replacing it) checked for SFT:
    `encode(messages, where)` renders a conversation, tokenizes it whole and marks the tokens
    of its assistant turns. A turn is located as the text the template adds after the
    generation prompt: render(messages[:i], add_generation_prompt=True) and
    render(messages[:i + 1]) must both be prefixes of the whole conversation's render
    (prefix-stable), and the span between them must hold the message's content. Raises
    ConfigError (one line naming the fix) for a slow tokenizer (no offsets), no template, a
    template that fails, is not prefix-stable or does not show an assistant's content."""

    def __init__(self, tok, name: str, template: str | None = None):
        self.tok, self.name, self.template = tok, name, template or tok.chat_template
        if not self.template:
            raise ConfigError(f"--tokenizer: {name} has no chat template; pass --chat-template FILE "
                              "(a Jinja chat template, e.g. the model's chat_template.jinja)")
        if not tok.is_fast:
            raise ConfigError(f"--tokenizer: {name} is a slow (Python) tokenizer without token offsets; "
                              "use a directory with tokenizer.json (a fast tokenizer)")

    def _render(self, messages: list[dict], generation: bool, where: str) -> str:
        from jinja2 import TemplateError

        try:
            return self.tok.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                add_generation_prompt=generation)
        except (TemplateError, TypeError, ValueError) as e:
            raise ConfigError(f"--chat-template: the chat template of {self.name} fails on {where} "
                              f"({type(e).__name__}: {e}); pass --chat-template FILE") from None

    def encode(self, messages, where: str) -> tuple[list[int], list[int]]:
        """(token ids, loss mask) of conversation `messages` ([{role, content}], text contents):
        mask 1 on each token that carries text of an assistant turn (its content and the
        template's turn end, e.g. `<|im_end|>`), 0 elsewhere. `where` names the row in errors."""
        import numpy as np

        if not is_chat(messages):
            raise ConfigError(f"--messages-key: {where} is not a non-empty list of {{role, content}} messages "
                              "with text contents (the OpenAI / Hugging Face chat format)")
        text = self._render(messages, False, where)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = self._render(messages[:i], True, where)
            end = self._render(messages[:i + 1], False, where)
            if not (text.startswith(start) and text.startswith(end) and len(start) <= len(end)):
                raise ConfigError(f"--chat-template: the chat template of {self.name} is not prefix-stable: {where} "
                                  f"renders its first {i + 1} messages differently once later ones follow (the "
                                  "template rewrites earlier turns); pass --chat-template FILE")
            if m["content"] not in end[len(start):]:
                raise ConfigError(f"--chat-template: cannot locate assistant message {i + 1} of {where} in the "
                                  f"chat template of {self.name}'s render (its content is not where the template "
                                  "puts the assistant's turn); pass --chat-template FILE")
            spans.append((len(start), len(end)))
        if not spans:
            raise ConfigError(f"--messages-key: {where} has no assistant message to train on")
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = np.array(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        mask = np.zeros(len(offsets), dtype=bool)
        for s, e in spans:
            mask |= (offsets[:, 0] < e) & (offsets[:, 1] > s)
        return list(enc["input_ids"]), mask.astype(int).tolist()


def prepare_sft(inputs: list[str], tokenizer: str, output_prefix: str, key: str = "messages",
                max_len: int | None = None, truncation: str = "error", chat_template: str | None = None) -> str:
    """SFT data: column `key` of every row of `inputs` (in order) is one conversation
    ([{role, content}]), rendered by the tokenizer's chat template (or the Jinja file
    `chat_template`) into one document of `{output_prefix}_{key}_document` (.bin/.idx, as
    `prepare` writes; no EOD appended: the template ends the turns) and its loss mask into the
    uint8 dataset `..._document_loss_mask` (same lengths; 1 = an assistant token,
    `ChatTemplate.encode`). A conversation longer than `max_len` tokens is an error, or with
    truncation "right" / "left" keeps its first / last `max_len` tokens. Returns the tokens'
    prefix. Raises ConfigError (one line) for bad rows, templates or lengths."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    from ftrain.data.dataset import LOSS_MASK_SUFFIX, load_tokenizer

    tok = load_tokenizer(tokenizer, "--tokenizer")
    if chat_template is not None and not Path(chat_template).is_file():
        raise ConfigError(f"--chat-template: {chat_template}: no such file")
    chat = ChatTemplate(tok, tokenizer, Path(chat_template).read_text(encoding="utf-8") if chat_template else None)
    prefix = f"{output_prefix}_{key}_document"
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    tokens = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(len(tok)))
    masks = IndexedDatasetBuilder(prefix + LOSS_MASK_SUFFIX + ".bin", dtype=np.uint8)
    docs = 0
    for path in inputs:
        for n, row in enumerate(read_rows(path, "--input"), 1):
            _column(row, key, path, n, "--messages-key")
            ids, mask = chat.encode(row[key], f"conversation {n:,} of {path}")
            if max_len is not None and len(ids) > max_len:
                if truncation == "error":
                    raise ConfigError(f"--max-len: conversation {n:,} of {path} is {len(ids):,} tokens, more than "
                                      f"--max-len {max_len:,}; raise --max-len (and train.seq_len) or pass "
                                      "--truncation right (keep its start) or left (keep its end)")
                keep = slice(None, max_len) if truncation == "right" else slice(len(ids) - max_len, None)
                ids, mask = ids[keep], mask[keep]
                if not any(mask):
                    raise ConfigError(f"--truncation: conversation {n:,} of {path} has no assistant token in its "
                                      f"{'first' if truncation == 'right' else 'last'} {max_len:,} tokens "
                                      f"(--truncation {truncation}); raise --max-len")
            tokens.add_document(np.array(ids, dtype=np.int64), [len(ids)])
            masks.add_document(np.array(mask, dtype=np.uint8), [len(mask)])
            docs += 1
    tokens.finalize(prefix + ".idx")
    masks.finalize(prefix + LOSS_MASK_SUFFIX + ".idx")
    if not docs:
        raise ConfigError(f"--input: no conversations in {', '.join(inputs)}")
    return prefix


def train_stdlib_tokenizer(out_dir: str | Path, vocab_size: int = 2048) -> Path:
    """A byte-level BPE tokenizer of `vocab_size` tokens trained on Python's
    `pydoc_data/topics.py` (real English text, no download; the same bytes on every run of one
    Python), special tokens `SPECIAL_TOKENS`, saved as a Hugging Face directory that
    `AutoTokenizer` loads (EOS <|endoftext|>, pad <|pad|>). Returns the directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = (Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data" / "topics.py").read_text(encoding="utf-8")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(text.splitlines(keepends=True), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out = Path(out_dir)
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|pad|>").save_pretrained(out)
    return out


def stdlib_corpus(out_dir: str | Path, max_files: int | None = None) -> tuple[Path, str]:
    """The offline demo corpus in `out_dir`: `tokenizer/` (`train_stdlib_tokenizer`),
    `stdlib.jsonl` (one row {"text", "path"} per standard-library .py file, sorted by path,
    tests and site-packages left out; the first `max_files` of them) and its prepared dataset
    `stdlib_text_document`. Returns (tokenizer dir, dataset prefix)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_stdlib_tokenizer(out / "tokenizer")
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not {"site-packages", "test", "tests", "idlelib"}
                   & set(p.relative_to(root).parts))[:max_files]
    with (out / "stdlib.jsonl").open("w", encoding="utf-8") as f:
        for p in files:
            f.write(json.dumps({"text": p.read_text(encoding="utf-8", errors="replace"),
                                "path": str(p.relative_to(root))}) + "\n")
    return tok, prepare([str(out / "stdlib.jsonl")], str(tok), str(out / "stdlib"))


def inspect_step(cfg, step: int, rows: int = 2, dp: int | None = None) -> str:
    """What step `step` of `cfg` (resolved) trains on: the data line, the global batch's digest
    (`TrainingBatch.digest`, as `train` logs it) and its first `rows` rows (with dp, replica 0
    of dp's), decoded when a tokenizer is known."""
    from ftrain.data.dataset import open_data
    from ftrain.distributed.parallel_dims import ParallelDims

    data = open_data(cfg)
    dp = dp or ParallelDims.from_config(cfg).dp
    batch = data.batch(step)
    lines = [data.describe(cfg.train.steps), f"step {step}: data_digest={batch.digest()} "
             f"rows={len(batch)} seq_len={batch.input_ids.shape[1]} dp={dp}"]
    for (g, k, e, w), ids in zip(data.addresses(step, dp, 0)[:rows], data.rows(step, dp, 0)[:rows]):
        text = data.tokenizer.decode(ids.tolist()) if data.tokenizer is not None else " ".join(map(str, ids[:32]))
        lines.append(f"row g={g} dataset={data.names[k]} epoch={e} window={w}: {text!r}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """`main.py data MODE ...`; returns the exit status (2 with one line for bad input)."""
    p = argparse.ArgumentParser(prog="main.py data", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = p.add_subparsers(dest="mode", required=True, metavar="MODE")
    prep = modes.add_parser("prepare", help="jsonl / jsonl.gz / parquet -> Megatron .bin/.idx")
    prep.add_argument("--input", nargs="+", required=True, metavar="FILE",
                      help="input files or s3:// / gs:// URLs, read in order")
    prep.add_argument("--tokenizer", required=True, metavar="DIR", help="local Hugging Face tokenizer directory")
    prep.add_argument("--output-prefix", required=True, metavar="PREFIX",
                      help="writes PREFIX_KEY_document.bin/.idx (Megatron-LM's naming)")
    prep.add_argument("--json-keys", default="text", metavar="KEY", help="the text column (default: text)")
    prep.add_argument("--no-append-eod", action="store_true", help="do not end each document with the EOS id")
    sft = prep.add_argument_group("SFT (one conversation per row, loss on assistant tokens; docs/data.md)")
    sft.add_argument("--messages-key", metavar="KEY", help="the chat column ([{role, content}]): SFT data, "
                     "rendered with the chat template, plus PREFIX_KEY_document_loss_mask.bin/.idx")
    sft.add_argument("--max-len", type=int, metavar="N", help="longest conversation in tokens (train.seq_len)")
    sft.add_argument("--truncation", choices=["error", "right", "left"], default="error",
                     help="a conversation over --max-len: error (default), keep its start (right) or end (left)")
    sft.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template instead of the tokenizer's")
    insp = modes.add_parser("inspect", help="what step S trains on (no Ray, no GPU)")
    insp.add_argument("--config", default="config.yaml", metavar="FILE")
    insp.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE")
    insp.add_argument("--step", type=int, required=True, metavar="S")
    insp.add_argument("--rows", type=int, default=2, metavar="N", help="rows to print (default 2)")
    std = modes.add_parser("stdlib", help="offline demo corpus: BPE tokenizer + the stdlib prepared")
    std.add_argument("--output-dir", default="runs/stdlib_corpus", metavar="DIR")
    std.add_argument("--max-files", type=int, default=None, metavar="N")
    ari = modes.add_parser("arithmetic", help="GSM8K-style RL prompt set (veRL layout): a + b, answer after ####")
    ari.add_argument("--output", default="runs/arithmetic/train.parquet", metavar="FILE", help=".parquet or .jsonl")
    ari.add_argument("--rows", type=int, default=500, metavar="N")
    ari.add_argument("--seed", type=int, default=0)
    ari.add_argument("--plain", action="store_true", help="prompts as plain strings, not chat lists")
    args = p.parse_args(argv)
    try:
        if args.mode == "prepare" and args.messages_key is not None:
            print(prepare_sft(args.input, args.tokenizer, args.output_prefix, args.messages_key, args.max_len,
                              args.truncation, args.chat_template))
        elif args.mode == "prepare":
            if args.max_len is not None or args.truncation != "error" or args.chat_template is not None:
                raise ConfigError("--max-len, --truncation and --chat-template are for SFT data: pass "
                                  "--messages-key COLUMN")
            print(prepare(args.input, args.tokenizer, args.output_prefix, args.json_keys, not args.no_append_eod))
        elif args.mode == "inspect":
            if args.step < 1:
                raise ConfigError(f"--step {args.step}: steps count from 1")
            raw = load_config(args.config, args.overrides)
            print(inspect_step(resolve(raw, num_gpus=raw.cluster.gpus_per_node or None), args.step, args.rows))
        elif args.mode == "arithmetic":
            from ftrain.data.prompt_set import write_arithmetic_prompts
            print(write_arithmetic_prompts(args.output, args.rows, args.seed, chat=not args.plain))
        else:
            tok, prefix = stdlib_corpus(args.output_dir, args.max_files)
            print(f"tokenizer {tok}\ndataset {prefix}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
