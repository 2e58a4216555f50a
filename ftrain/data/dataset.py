"""Training data as a pure function of (data, seed, step): the sample address and its rows.

Sources are Megatron indexed datasets (.bin/.idx in megatron-core's layout, read by `IndexedFile`),
weighted blends of them, and megatron-core's mock dataset. A sample is a packed window of
`train.seq_len` tokens: megatron-core's `build_sample_idx` with sequence length seq_len - 1 and
the extra label token, over the document order `RandomState(seed).shuffle` - the windows of
Megatron's own `GPTDataset(sequence_length=seq_len - 1)`, bit for bit. For SFT data
(`Conversations`) a sample is one conversation, padded, with its stored loss mask. Only the
order is ours:

    g      = (step - 1) * GBS + j                 row j of step `step`, j in [0, GBS)
    (k, c) = blend(g)                             megatron's greedy blending (prefix-stable)
    (e, i) = divmod(c, N_k)                       N_k = windows in one epoch of dataset k
    w      = P_{k,e}(i)                           a seeded permutation of [0, N_k) per (seed, k, e)
    row    = window w of dataset k

Nothing here depends on `train.steps` or dp (GPTDataset's order depends on the sample count:
a longer run would reshuffle everything), and nothing is state: no loader position goes into
checkpoints. DP replica d of dp trains rows j = d, d + dp, ... (`dispatch.MeshDispatch`), so
`rows(step, dp, d)` is what that replica needs and the global batch is the same at any dp.

Files are checked when opened (`open_data`): one `ConfigError` line per problem (missing or
truncated .bin/.idx, a path with its extension, token ids beyond the model's vocabulary, fewer
windows than one global batch) before any actor starts. Rows are read with checked range reads
of the .bin and .idx (`IndexedFile`: `os.pread`, no memory map): a row that cannot be read
mid-run (a file truncated or replaced in place since, an I/O error) raises `DataError` naming
step, row and document instead of killing the reader with SIGBUS or training on what a short
read left in its buffer. A `Data` pickles as the `DataSpec` it was opened from: a rank
actor that receives one opens the same files with `IndexedFile`'s header checks only (`rank_rows.RankRows`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import logging
import os
import struct
from pathlib import Path

import numpy as np
import torch

from ftrain.config import Config, ConfigError, parse_blend
from ftrain.data.training_batch import TrainingBatch
from ftrain.failures import DataError

log = logging.getLogger("ftrain.data")  # the data part's log: `logger=data` in log lines

_INDEX_HEADER = b"MMIDIDX\x00\x00"  # megatron.core.datasets.indexed_dataset._INDEX_HEADER
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
           7: np.float32, 8: np.uint16}  # indexed_dataset.DType codes
_SCAN_TOKENS = 1 << 26  # token-id range check: every token up to this many, else spread samples
LOSS_MASK_SUFFIX = "_loss_mask"  # SFT: {tokens prefix}_loss_mask.bin/.idx, uint8, 1 = an assistant token


def index_header(prefix: str) -> dict:
    """Check the files of Megatron dataset `prefix` against each other, without megatron-core:
    both exist, the .idx header, version and dtype code are Megatron's, its size matches its
    counts, and the .bin holds every byte the index points to (the last three: `IndexedFile`'s
    parse). Returns {dtype, sequences, documents, lengths (int32 [sequences]), tokens}. Raises
    ConfigError naming data.path."""
    base = os.path.basename(prefix)
    if "://" in prefix:
        raise ConfigError(f"data.path: {prefix}: an indexed dataset is read from a local or mounted path (each rank "
                          "reads byte ranges of its .bin every step); copy the .bin/.idx to the nodes' disks or "
                          "mount the bucket")
    if prefix.endswith((".bin", ".idx")):
        raise ConfigError(f"data.path: give the prefix without .bin/.idx: {prefix[:-4]}")
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    if not (idx.is_file() and bin_.is_file()):
        folder = idx.parent
        found = sorted(p.name for p in folder.glob(base + ".*")) if folder.is_dir() else []
        raise ConfigError(f"data.path: {prefix}: no Megatron dataset there (looked for {bin_.name} and "
                          f"{idx.name}; found: {', '.join(found) if found else 'nothing'})")
    f = IndexedFile(prefix)
    f.close()
    return {"dtype": f.dtype, "sequences": len(f), "documents": f.documents, "lengths": f.sequence_lengths,
            "tokens": int(f.sequence_lengths.sum(dtype=np.int64))}


def check_reachable(url: str, field: str) -> None:
    """The object at fsspec URL `url` (s3://, gs://, ...) exists and its storage answers (one
    metadata request, with the client's own retries), so an unreachable endpoint, a missing
    bucket or object, or refused credentials show in one line before any actor starts.
    Raises ConfigError naming `field`, the URL and the client's error."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url)
        fs.info(path)
    except FileNotFoundError:
        raise ConfigError(f"{field}: {url}: no such object (or no such bucket) at its storage endpoint") from None
    except Exception as e:  # noqa: BLE001 - any client's error (botocore's and gcsfs's are not OSError)
        detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"{field}: cannot reach {url}: {type(e).__name__}: {detail}; check the URL, the "
                          "endpoint (e.g. AWS_ENDPOINT_URL) and the credentials") from None


def check_token_ids(prefix: str, header: dict, vocab_size: int) -> None:
    """Every token id of `prefix`'s .bin (or, beyond 2^26 tokens, 4,096 evenly spread runs of
    it) is below `vocab_size` (the embedding rows). Raises ConfigError naming the largest id."""
    tokens = np.memmap(prefix + ".bin", dtype=header["dtype"], mode="r", shape=(header["tokens"],))
    if header["tokens"] <= _SCAN_TOKENS:
        top, what = int(tokens.max(initial=0)), "all tokens"
    else:
        step = header["tokens"] // 4096
        top, what = max(int(tokens[s:s + 1024].max()) for s in range(0, header["tokens"], step)), \
            "4,096 sampled runs"
    if top >= vocab_size:
        raise ConfigError(f"data.path: token ids up to {top:,} in {prefix} ({what}) but the model has "
                          f"{vocab_size:,} (model.vocab_size); tokenized with another tokenizer?")


def check_sft_masks(prefix: str, header: dict, seq_len: int) -> None:
    """The loss masks of SFT dataset `prefix` (`prefix` + LOSS_MASK_SUFFIX, made with it by
    `data prepare --messages-key`) exist, are uint8 and have its conversations' lengths,
    and no conversation is longer than `seq_len` (train.seq_len). Raises ConfigError naming
    data.path and the fix."""
    masks = prefix + LOSS_MASK_SUFFIX
    if not (Path(masks + ".bin").is_file() and Path(masks + ".idx").is_file()):
        raise ConfigError(f"data.path: {prefix} has no SFT loss masks ({os.path.basename(masks)}.bin/.idx); "
                          "make SFT data with `main.py data prepare --messages-key messages`, or train it as "
                          "text with data.kind=indexed")
    mh = index_header(masks)
    if mh["dtype"] != np.uint8 or not np.array_equal(mh["lengths"], header["lengths"]):
        raise ConfigError(f"data.path: {masks} does not match {prefix} ({mh['sequences']:,} masks, "
                          f"{header['sequences']:,} conversations, or other lengths or dtype); prepare them "
                          "again together with `main.py data prepare --messages-key`")
    longest = int(np.argmax(header["lengths"])) if header["sequences"] else 0
    if header["sequences"] and header["lengths"][longest] > seq_len:
        raise ConfigError(f"data.path: conversation {longest + 1:,} of {prefix} is {header['lengths'][longest]:,} "
                          f"tokens, more than train.seq_len={seq_len:,}; raise train.seq_len or prepare again "
                          f"with --max-len {seq_len} (--truncation right to cut longer ones)")


def _stable_seed(*parts) -> int:
    """A 63-bit seed that is a pure function of `parts` (no global RNG, no Python hash)."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


class IndexedFile:
    """One Megatron indexed dataset (`prefix`.bin/.idx) read with checked range reads and no
    memory map: a mapped file truncated or replaced under a run kills its reader with SIGBUS
    (a rank failure that spends spares), a read here raises DataError instead. The index is
    read once, when opened: `sequence_lengths` (int32 [documents]) and the pointers (int64
    [documents]), 12 bytes per document in this process (the .idx's size; one pointer read
    per document from the .idx instead costs a third more time per step); an .idx changed
    later is not read again. Opening checks the files against each other: the .idx header,
    version and dtype code are Megatron's, its size matches its counts, the .bin holds every
    byte the index points to (ConfigError naming data.path, `index_header`'s checks). Each `get`
    is one `os.pread` of the .bin (thread-safe: the prefetch thread reads while the compute
    thread trains). The .bin is opened once: a file replaced by a rename keeps being read as
    it was opened. Raises DataError (naming the file, the document and the bytes) when a read
    fails or comes back short."""

    def __init__(self, prefix: str):
        self.path_prefix = prefix
        with open(prefix + ".idx", "rb", buffering=0) as idx:
            size = os.fstat(idx.fileno()).st_size
            head = self._read(idx, min(size, 34), 0, "header")
            if head[:9] != _INDEX_HEADER:
                raise ConfigError(f"data.path: {idx.name} is not a Megatron index (header {head[:9]!r} is not "
                                  f"{_INDEX_HEADER!r}; partial copy, or written by another tool?)")
            if len(head) < 34:
                raise ConfigError(f"data.path: {idx.name} has {size:,} bytes, less than its 34-byte header (truncated?)")
            version, code, sequences, self.documents = struct.unpack("<QBQQ", head[9:34])
            if version != 1 or code not in _DTYPES:
                raise ConfigError(f"data.path: {idx.name}: version {version}, dtype code {code}: not a Megatron "
                                  "index this megatron-core reads (version 1, codes 1-8)")
            want = 34 + sequences * (4 + 8) + self.documents * 8
            if size != want:
                raise ConfigError(f"data.path: {idx.name} has {size:,} bytes but its counts ({sequences:,} sequences, "
                                  f"{self.documents:,} document marks) need {want:,} (truncated, multimodal, or still "
                                  "being copied?)")
            self.sequence_lengths = np.frombuffer(self._read(idx, 4 * sequences, 34, "lengths"), np.int32)
            self._pointers = np.frombuffer(self._read(idx, 8 * sequences, 34 + 4 * sequences, "pointers"), np.int64)
        self.dtype = np.dtype(_DTYPES[code])
        self._bin = open(prefix + ".bin", "rb", buffering=0)  # open for the run: pread per document
        end = int(self._pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize if sequences else 0
        if (have := os.fstat(self._bin.fileno()).st_size) < end:
            self.close()
            raise ConfigError(f"data.path: {self._bin.name} has {have:,} bytes but its index points to "
                              f"{end:,} (truncated, or still being copied?)")

    def close(self) -> None:
        """Close the .bin (`get` then fails)."""
        self._bin.close()

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @staticmethod
    def _read(f, size: int, at: int, what) -> bytes:
        try:
            data = os.pread(f.fileno(), size, at)
        except OSError as e:
            raise DataError(f"{what} of {f.name}: {e.strerror} reading {size:,} bytes at offset {at:,}") from None
        if len(data) != size:
            raise DataError(f"{what} of {f.name}: read {len(data):,} of {size:,} bytes at offset {at:,} (the file "
                            "was truncated or replaced after the run's checks)")
        return data

    def get(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of document `doc` (to its end when length is None),
        as `IndexedDataset.get` returns them. Raises DataError."""
        count = int(self.sequence_lengths[doc]) - offset if length is None else length
        size = self.dtype.itemsize
        at = int(self._pointers[doc]) + offset * size
        return np.frombuffer(self._read(self._bin, count * size, at, f"document {doc}"), self.dtype)


class Windows:
    """The packed windows of one low-level dataset (an `IndexedFile` or megatron-core's
    `MockGPTLowLevelDataset`): Megatron's `build_sample_idx` over the documents in the order
    `numpy.random.RandomState(seed).shuffle(arange(documents))` (GPTDataset's one-epoch order),
    windows of `seq_len` tokens (seq_len - 1 inputs and labels plus the shared extra token).
    `len(self)` windows; `window(w)` int64 [seq_len]."""

    def __init__(self, low, seq_len: int, seed: int):
        from megatron.core.datasets import helpers

        self.low, self.seq_len = low, seq_len
        sizes = np.asarray(low.sequence_lengths, dtype=np.int32)
        self.document_index = np.arange(len(sizes), dtype=np.int32)
        np.random.RandomState(seed % 2**32).shuffle(self.document_index)
        self.sample_index = helpers.build_sample_idx(sizes, self.document_index, seq_len - 1, 1,
                                                     int(sizes.sum(dtype=np.int64)), True, True)

    def __len__(self) -> int:
        return len(self.sample_index) - 1

    def window(self, w: int) -> np.ndarray:
        """Tokens of window `w` (int64 [seq_len]), read as GPTDataset reads sample text.
        Raises DataError when the files cannot give them."""
        (beg, beg_off), (end, end_off) = self.sample_index[w], self.sample_index[w + 1]
        docs, get = self.document_index, self.low.get
        if beg == end:
            parts = [get(int(docs[beg]), offset=int(beg_off), length=int(end_off - beg_off + 1))]
        else:
            parts = [get(int(docs[i]), offset=int(beg_off) if i == beg else 0,
                         length=int(end_off + 1) if i == end else None) for i in range(int(beg), int(end) + 1)]
        out = np.concatenate(parts).astype(np.int64)
        if len(out) != self.seq_len:
            raise RuntimeError(f"window {w} has {len(out)} tokens, not {self.seq_len}")
        return out


class Conversations:
    """The conversations of one SFT dataset (`data_prepare.prepare_sft`), one per sample: sample
    w is document w of `low` (an `IndexedFile`), right-padded to `seq_len` with `pad_id`
    (the window order's permutation shuffles them; nothing is packed). `masks` is the parallel
    uint8 dataset of its loss masks (1 = an assistant token). `len(self)` conversations;
    `window(w)` int64 [seq_len]; `sample_masks(w)` (attention int64, loss float32) [seq_len]."""

    def __init__(self, low, masks, seq_len: int, pad_id: int):
        self.low, self.masks, self.seq_len, self.pad_id = low, masks, seq_len, pad_id

    def __len__(self) -> int:
        return len(self.low)

    def window(self, w: int) -> np.ndarray:
        """Tokens of conversation `w`, then pad_id up to seq_len (int64 [seq_len])."""
        out = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        ids = self.low.get(int(w))
        out[:len(ids)] = ids
        return out

    def sample_masks(self, w: int) -> tuple[np.ndarray, np.ndarray]:
        """(attention_mask int64: 1 on the conversation's tokens; loss_mask float32: its stored
        mask, 0 on padding and on column 0, which no logit predicts), each [seq_len]."""
        mask = self.masks.get(int(w))
        attention, loss = np.zeros(self.seq_len, np.int64), np.zeros(self.seq_len, np.float32)
        attention[:len(mask)] = 1
        loss[1:len(mask)] = mask[1:]
        return attention, loss


class Data:
    """The rows of every step of one run: `rows(step, dp, d)` / `batch(step)`, pure functions
    of (datasets, weights, seed, seq_len, global_batch_size, eod settings) and their arguments.

    Args:
        datasets: [(weight, Windows or Conversations)] (all of one kind), weights > 0 (normalised here).
        seed: seed of the window permutations (each dataset's document order has its own).
        global_batch_size: GBS, rows per step.
        eod_id / eod_mask_loss: with eod_mask_loss, no loss on a token that follows eod_id.
        names: the datasets' names, for messages and `describe`.
        tokenizer: the HF tokenizer the data were made with, or None (`data inspect` decodes).
        spec: the `DataSpec` these were opened from (`DataSpec.open`): a Data pickles as it
            (the tokenizer is left behind); None: not picklable.
    """

    _BLEND_MIN = 1 << 16  # blending indices are built for at least this many samples

    def __init__(self, datasets: list[tuple[float, Windows]], seed: int, global_batch_size: int,
                 eod_id: int | None = None, eod_mask_loss: bool = False, names: list[str] | None = None,
                 tokenizer=None, spec: DataSpec | None = None):
        total = sum(w for w, _ in datasets)
        self.weights = np.array([w / total for w, _ in datasets], dtype=np.float64)
        self.windows = [ds for _, ds in datasets]
        self.names = names or [f"dataset{k}" for k in range(len(datasets))]
        self.seed, self.gbs = seed, global_batch_size
        self.eod_id, self.eod_mask_loss, self.tokenizer = eod_id, eod_mask_loss, tokenizer
        self._blend = (np.zeros(0, np.int16), np.zeros(0, np.int64))
        self._perms: dict[tuple[int, int], np.ndarray] = {}
        self.spec = spec

    def __reduce__(self):
        if self.spec is None:
            raise TypeError("a Data not opened from a DataSpec (open_data / DataSpec.open) cannot be sent to a rank")
        return DataSpec.open, (self.spec,)

    @property
    def fixed_mask(self) -> bool:
        """Whether every row's loss mask is the same (no eod_mask_loss, no SFT masks): a
        mini-batch's masked tokens are then its rows x (seq_len - 1), known without reading the
        other rows."""
        return not (self.eod_mask_loss and self.eod_id is not None) and not isinstance(self.windows[0], Conversations)

    def _locate(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dataset k, its sample count c before g) for global samples `g`. Megatron's greedy
        blending is prefix-stable, so the arrays grow (doubling) without changing their prefix."""
        if len(self.windows) == 1:
            return np.zeros_like(g), g
        need = int(g.max()) + 1
        if need > len(self._blend[0]):
            from megatron.core.datasets import helpers

            size = max(self._BLEND_MIN, 1 << (need - 1).bit_length())
            index, sample = np.zeros(size, np.int16), np.zeros(size, np.int64)
            helpers.build_blending_indices(index, sample, self.weights, len(self.windows), size, False)
            self._blend = (index, sample)
        return self._blend[0][g].astype(np.int64), self._blend[1][g]

    def _permutation(self, k: int, epoch: int) -> np.ndarray:
        """P_{k,epoch}: the window order of dataset k in that epoch (a few kept)."""
        key = (k, epoch)
        if key not in self._perms:
            if len(self._perms) >= 4 * len(self.windows):
                self._perms.pop(next(iter(self._perms)))
            rng = np.random.default_rng(_stable_seed("perm", self.seed, k, epoch))
            self._perms[key] = rng.permutation(len(self.windows[k]))
        return self._perms[key]

    def addresses(self, step: int, dp: int = 1, d: int = 0) -> list[tuple[int, int, int, int]]:
        """(g, dataset k, epoch e, window w) of the rows replica d of dp trains at `step`:
        global rows j = d, d + dp, ... < GBS. Raises ValueError for step < 1 or a d/dp that does
        not split GBS."""
        if step < 1 or not 0 <= d < dp or self.gbs % dp:
            raise ValueError(f"no rows for step {step}, replica {d} of dp={dp} (GBS {self.gbs})")
        g = np.arange(d, self.gbs, dp, dtype=np.int64) + (step - 1) * self.gbs
        ks, cs = self._locate(g)
        out = []
        for gi, k, c in zip(g.tolist(), ks.tolist(), cs.tolist()):
            e, i = divmod(c, len(self.windows[k]))
            out.append((gi, k, e, int(self._permutation(k, e)[i])))
        return out

    def rows(self, step: int, dp: int = 1, d: int = 0) -> np.ndarray:
        """Token ids (int64 [GBS / dp, seq_len]) of the rows replica d of dp trains at `step`.
        Raises DataError naming the step, the row and the document when one cannot be read."""
        return np.stack([self._read(step, g, k, w, self.windows[k].window)
                         for g, k, _, w in self.addresses(step, dp, d)])

    def _read(self, step: int, g: int, k: int, w: int, read):
        """read(w) for global row g of `step` (window w of dataset k); its DataError is raised
        again with the step, the row and the window in front."""
        try:
            return read(w)
        except DataError as e:
            raise DataError(f"step {step} row {g - (step - 1) * self.gbs} (window {w} of {self.names[k]}): "
                            f"{e}") from None

    def batch(self, step: int, dp: int = 1, d: int = 0) -> TrainingBatch:
        """`rows` as a TrainingBatch: attention_mask all ones, loss_mask 1 from column 1 on (no
        logit predicts column 0), 0 after an EOD with eod_mask_loss; no advantages. SFT
        (`Conversations`): each conversation's attention and loss masks (`sample_masks`)."""
        ids = torch.from_numpy(self.rows(step, dp, d))
        if isinstance(self.windows[0], Conversations):
            attention, loss = zip(*(self._read(step, g, k, w, self.windows[k].sample_masks)
                                    for g, k, _, w in self.addresses(step, dp, d)))
            return TrainingBatch(input_ids=ids, attention_mask=torch.from_numpy(np.stack(attention)),
                                 loss_mask=torch.from_numpy(np.stack(loss)), advantages=None)
        mask = torch.ones(ids.shape, dtype=torch.float32)
        mask[:, 0] = 0
        if self.eod_mask_loss and self.eod_id is not None:
            mask[:, 1:] *= (ids[:, :-1] != self.eod_id).float()
        return TrainingBatch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=mask, advantages=None)

    def describe(self, steps: int) -> str:
        """One `event=data` line: windows per epoch, weights, epochs `steps` steps need."""
        seq = self.windows[0].seq_len
        per = ", ".join(f"{n}:{len(ds)}" for n, ds in zip(self.names, self.windows))
        epochs = max(steps * self.gbs * w / len(ds) for w, ds in zip(self.weights, self.windows))
        return (f"event=data windows_per_epoch={per} weights={','.join(f'{w:.4g}' for w in self.weights)} "
                f"epochs={epochs:.3g} tokens_per_step={self.gbs * seq}")


def load_tokenizer(path: str, name: str = "data.tokenizer"):
    """A local Hugging Face tokenizer directory through `AutoTokenizer` (never a class built
    directly: a wrong class silently gives a 3-token tokenizer). Raises ConfigError naming the
    setting as the user gave it (`name`: the config key, or a command's flag)."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise ConfigError(f"{name}: {path!r} is not a local directory (tokenizer.json, "
                          "tokenizer_config.json); nothing is downloaded at run time")
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{name}: {path}: cannot load it with AutoTokenizer: {e}") from None
    return tok


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """What `open_data` resolved from the config after its checks: enough to open the same
    `Data` anywhere the files are (a rank actor), without the checks or the tokenizer.
    sources: ((weight, prefix or "mock"), ...); eod_id: resolved (tokenizer's EOS, data.eod_id,
    or for mock vocab_size - 1); vocab_size: the mock dataset's; pad_id: sft's padding (the
    tokenizer's pad id, else the EOD id, else 0)."""

    kind: str
    sources: tuple[tuple[float, str], ...]
    seed: int
    seq_len: int
    global_batch_size: int
    eod_id: int | None
    eod_mask_loss: bool
    vocab_size: int
    pad_id: int = 0

    def open(self, tokenizer=None) -> Data:
        """The `Data` of this spec: its .idx files opened, its windows built (megatron-core's
        compiled helpers), its files opened for checked range reads (`IndexedFile`)."""
        if self.kind == "mock":
            from types import SimpleNamespace

            from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset

            lows = [MockGPTLowLevelDataset(SimpleNamespace(vocab_size=self.vocab_size, eod=self.eod_id))]
        else:
            lows = [IndexedFile(p) for _, p in self.sources]
        if self.kind == "sft":  # one conversation per row, its loss mask beside it
            windows = [(w, Conversations(low, IndexedFile(p + LOSS_MASK_SUFFIX), self.seq_len,
                                         self.pad_id)) for (w, p), low in zip(self.sources, lows)]
        else:
            windows = [(w, Windows(low, self.seq_len, self.seed)) for (w, _), low in zip(self.sources, lows)]
        return Data(windows, self.seed, self.global_batch_size, self.eod_id, self.eod_mask_loss,
                    [p for _, p in self.sources], tokenizer, self)


def open_data(cfg: Config) -> Data:
    """The run's `Data` for data.kind mock, indexed or sft, every file checked first (see
    `index_header`, `check_token_ids`, `check_sft_masks`), the tokenizer (data.tokenizer, else
    model.hf_path) checked against model.vocab_size. Raises ConfigError (one line naming the
    field) for bad input, fewer windows (conversations) than one global batch in a dataset, or
    megatron-core without its compiled dataset helpers."""
    d, t, m = cfg.data, cfg.train, cfg.model
    if d.kind not in ("mock", "indexed", "sft"):
        raise ValueError(f"data.kind={d.kind!r} has no dataset to open")
    seed = t.seed if d.seed is None else d.seed
    pairs = parse_blend(d.blend) if d.blend is not None else [(1.0, d.path)]
    headers = [(w, os.path.expanduser(p), index_header(os.path.expanduser(p))) for w, p in pairs] \
        if d.kind in ("indexed", "sft") else []  # the files first: numpy only, no slow imports
    for _, p, h in headers if d.kind == "sft" else []:
        check_sft_masks(p, h, t.seq_len)
    tok_path = d.tokenizer or m.hf_path
    tok = load_tokenizer(tok_path) if tok_path else None
    if tok is not None and len(tok) > m.vocab_size:
        raise ConfigError(f"data.tokenizer: {tok_path} has {len(tok):,} tokens, more than model.vocab_size="
                          f"{m.vocab_size:,} (the embedding rows); raise model.vocab_size or use the "
                          "model's own tokenizer")
    eod = d.eod_id if d.eod_id is not None else getattr(tok, "eos_token_id", None)
    if d.kind == "mock":
        eod = m.vocab_size - 1 if eod is None else eod
        sources = ((1.0, "mock"),)
    else:
        if d.eod_mask_loss and eod is None:
            raise ConfigError("data.eod_mask_loss: no end-of-document id: set data.tokenizer (its EOS) "
                              "or data.eod_id")
        for _, p, h in headers:
            check_token_ids(p, h, m.vocab_size)
        sources = tuple((w, p) for w, p, _ in headers)
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        raise ConfigError("data.path: megatron-core has no C++ dataset helpers (megatron.core.datasets."
                          "helpers_cpp): it was built without a C++ compiler; reinstall it from a PyPI wheel "
                          "(cp311-cp313 x86_64, cp312 aarch64) or with g++ available") from None
    pad = next(i for i in (getattr(tok, "pad_token_id", None), eod, 0) if i is not None)  # sft: padding
    data = DataSpec(d.kind, sources, seed, t.seq_len, t.global_batch_size, eod, d.eod_mask_loss,
                    m.vocab_size, pad).open(tok)
    unit = "conversations" if d.kind == "sft" else f"windows of {t.seq_len:,} tokens"
    for ds, name in zip(data.windows, data.names):
        if len(ds) < t.global_batch_size:
            raise ConfigError(f"data.path: {len(ds):,} {unit} in {name}, fewer than "
                              f"one global batch (train.global_batch_size={t.global_batch_size}); add data "
                              "or lower train.seq_len / train.global_batch_size")
    return data


def data_fingerprint(cfg: Config) -> str | None:
    """16 hex digits naming the data a run trains on: data.* and, per indexed dataset, the
    SHA-256 of its .idx and the size of its .bin, and for sft those of its loss masks, or the
    SHA-256 of a prompt set's file (None for synthetic batches). Two runs with
    equal fingerprints read the same rows at every step."""
    d = cfg.data
    if d.kind == "synthetic":
        return None
    h = hashlib.sha256(repr(sorted(dataclasses.asdict(d).items())).encode())
    if d.kind == "prompts":  # the file's bytes (its tokens depend on data.tokenizer, in data.*)
        import fsspec

        with fsspec.open(d.path if "://" in d.path else os.path.expanduser(d.path), "rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    if d.kind in ("indexed", "sft"):
        pairs = parse_blend(d.blend) if d.blend is not None else [(1.0, d.path)]
        prefixes = [os.path.expanduser(p) for _, p in pairs]
        for p in prefixes + [p + LOSS_MASK_SUFFIX for p in prefixes if d.kind == "sft"]:
            with open(p + ".idx", "rb") as f:
                h.update(hashlib.file_digest(f, "sha256").digest())
            h.update(str(Path(p + ".bin").stat().st_size).encode())
    return h.hexdigest()[:16]
