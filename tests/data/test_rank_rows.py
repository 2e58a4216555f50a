"""Ranks read their own rows (rank_rows.py): the same bytes, loss weights and digests as the
driver-side read of the global batch at dp 1, 2 and 4, through the prefetch and after a rewind;
a whole step trained from rank reads is bitwise the step trained from the driver's batch (the
DP all-reduce of masked tokens included); a .bin cut under a rank's reader (text, SFT tokens
or masks) is a DataError naming step, row and document (not rows from a short read's buffer),
an .idx cut changes no row (not SIGBUS); a .bin truncated mid-run stops the run (and the CLI,
exit 2) with one line and spends no spare."""
import os
import pickle
import re
import shutil

import numpy as np
import pytest
import torch
from test_data import data_cfg
from test_sft import sft_cfg, sft_corpus  # noqa: F401 - sft_corpus is a fixture

from dispatch import MeshDispatch
from ftrain.data.dataset import open_data
from ftrain.data.rank_rows import RankRows, global_digest
from ftrain.distributed.parallel_dims import ParallelDims
from ftrain.objectives.ppo import step_loss_weights


@pytest.mark.parametrize("eod_mask_loss", [False, True])
def test_rank_reads_equal_the_driver_read_at_dp_1_2_4(stdlib_corpus, eod_mask_loss):
    cfg = data_cfg(stdlib_corpus, f"data.eod_mask_loss={str(eod_mask_loss).lower()}")
    driver = open_data(cfg)
    assert driver.fixed_mask is not eod_mask_loss
    t = cfg.train
    for dp in (1, 2, 4):
        dims = ParallelDims(tp=1, pp=1, cp=1, dp=dp)
        ranks = [RankRows(pickle.loads(pickle.dumps(driver))) for _ in range(dp)]  # as a rank gets it
        for step in (1, 2, 3, 2, 7):  # prefetched, then a rewind to step 2, then a jump
            full = driver.batch(step)
            full.loss_weights = step_loss_weights(full.loss_mask, t, "token-mean", dp)
            per_rank = MeshDispatch.split(dims, (full,), {})
            counts = [driver.batch(step, dp, d).loss_mask.view(t.global_batch_size // t.mini_batch_size, -1)
                      .sum(1, dtype=torch.float64) for d in range(dp)]
            got = [rows.train_batch(step, dims, d, t, lambda _: sum(counts)) for d, rows in enumerate(ranks)]
            for d, batch in enumerate(got):
                want = per_rank[d][0][0]
                for field in ("input_ids", "attention_mask", "loss_mask", "loss_weights"):
                    assert torch.equal(getattr(batch, field), getattr(want, field)), (dp, step, d, field)
            assert global_digest([b.row_digests() for b in got]) == full.digest(), (dp, step)
            assert [rows.digests for rows in ranks] == [b.row_digests() for b in got], (dp, step)  # hashed where read


@pytest.mark.parametrize("rows, dp", [(16, 4), (16, 3), (5, 8), (7, 1)])
def test_the_global_digest_interleaves_the_replicas_rows(rows, dp):
    """Replica d holds global rows d, d + dp, ... (`MeshDispatch`): the digest is that of the rows
    in global order, for equal shares and for the unequal ones a DP shrink can leave."""
    from ftrain.data.training_batch import batch_digest

    digests = [bytes([j]) * 32 for j in range(rows)]
    assert global_digest([digests[d::dp] for d in range(dp)]) == batch_digest(digests)


def test_a_step_from_rank_reads_is_bitwise_the_step_from_the_driver_batch(ray_session, stdlib_corpus, tmp_path):
    from checkpoint import CheckpointManager
    from ftrain.control.actor_group import ActorGroup
    from ftrain.trainer import Trainer
    from megatron_actor import MegatronActor

    cfg = data_cfg(stdlib_corpus, "data.eod_mask_loss=true", tmp_path=tmp_path)  # dp=2, masks differ
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        full = trainer.data.batch(1)
        full.loss_weights = step_loss_weights(full.loss_mask, cfg.train, "token-mean", 2)
        driver = group.call("train_step", 1, full)
        driver_states = group.state_digests()
        group.call("rollback", 0)
        trainer.train(1)  # step 1 again, each rank reading its rows
        assert trainer.losses[1] == sum(r["loss"] for r in driver) / 2
        assert group.state_digests() == driver_states
        assert trainer.data_digests[1] == full.digest()
    finally:
        group.shutdown()


def test_a_bin_truncated_mid_run_stops_the_run_with_one_line_and_no_spare_spent(ray_session, stdlib_corpus,
                                                                                 tmp_path):
    from checkpoint import CheckpointManager
    from ftrain.control.actor_group import ActorGroup
    from ftrain.failures import DataError
    from ftrain.trainer import Trainer
    from megatron_actor import MegatronActor

    tok, prefix = stdlib_corpus
    copy = str(tmp_path / "corpus")
    for ext in (".bin", ".idx"):
        shutil.copyfile(prefix + ext, copy + ext)
    cfg = data_cfg((tok, copy), "cluster.num_spares=1", tmp_path=tmp_path)
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        trainer.train(1)
        os.truncate(copy + ".bin", 1000)
        with pytest.raises(DataError) as e:
            trainer.train(4)
        spares = len(group.pool)
    finally:
        group.shutdown()
    line = str(e.value)
    assert "\n" not in line and trainer.recoveries == [] and spares == 1
    assert re.match(r"step [23] row \d+ \(window \d+ of .*corpus\): document \d+ of .*corpus\.bin: "
                                  r"read [\d,]+ of [\d,]+ bytes", line), line


def _copy(prefix: str, out: str, suffixes=("",)) -> str:
    for suffix in suffixes:
        for ext in (".bin", ".idx"):
            shutil.copyfile(prefix + suffix + ext, out + suffix + ext)
    return out


def _many_documents(prefix: str, out: str, tokens_per_document: int = 40) -> str:
    """`prefix`'s tokens as documents of `tokens_per_document` tokens at `out` (an .idx of ten
    4 KiB pages: a memory-mapped one cut to its first page dies with SIGBUS)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    ds = IndexedDataset(prefix)
    tokens = np.concatenate([ds[i] for i in range(len(ds))])
    builder = IndexedDatasetBuilder(out + ".bin", dtype=tokens.dtype.type)
    for i in range(0, len(tokens) - tokens_per_document + 1, tokens_per_document):
        builder.add_document(tokens[i:i + tokens_per_document], [tokens_per_document])
    builder.finalize(out + ".idx")
    return out


def _reader(kind, stdlib_corpus, sft_corpus, tmp_path):
    """(config, `Data` opened from it, a `RankRows` over the Data as a rank gets it that has
    read step 1) on a copy of the corpus: `indexed`: documents of 40 tokens (an .idx of ten
    4 KiB pages), `sft`: the conversations with their masks."""
    from ftrain.data.dataset import LOSS_MASK_SUFFIX

    if kind == "indexed":
        tok, prefix = stdlib_corpus
        cfg = data_cfg((tok, _many_documents(prefix, str(tmp_path / "docs"))))
    else:
        tok, template, chats, rows, prefix = sft_corpus
        cfg = sft_cfg((tok, template, chats, rows, _copy(prefix, str(tmp_path / "chats"), ("", LOSS_MASK_SUFFIX))))
    data = open_data(cfg)
    reader = RankRows(pickle.loads(pickle.dumps(data)))
    reader.batch(1, 1, 0)  # and step 2 prefetched
    return cfg, data, reader


@pytest.mark.parametrize("kind, cut", [("indexed", ".bin"), ("sft", ".bin"), ("sft", "_loss_mask.bin")])
def test_a_file_cut_under_a_ranks_reader_is_a_data_error_naming_step_row_and_document(
        stdlib_corpus, sft_corpus, tmp_path, kind, cut):
    """The rank's reader (`RankRows`, its prefetch thread included) has read step 1, the file is
    cut to 4 KiB, the next steps raise DataError naming the step, the row, the window and the
    document in the cut file (an SFT row is not made of whatever a short read left in its
    buffer, as megatron-core's file reader gives it)."""
    from ftrain.failures import DataError

    cfg, _, reader = _reader(kind, stdlib_corpus, sft_corpus, tmp_path)
    os.truncate(cfg.data.path + cut, 4096)
    with pytest.raises(DataError) as e:
        for step in (2, 3):  # step 2 may have been prefetched before the cut
            reader.batch(step, 1, 0)
    assert re.fullmatch(rf"step {step} row \d+ \(window \d+ of {re.escape(cfg.data.path)}\): document \d+ of "
                        rf"{re.escape(cfg.data.path + cut)}: read [\d,]+ of [\d,]+ bytes at offset [\d,]+ \(the file "
                        r"was truncated or replaced after the run's checks\)", str(e.value)), str(e.value)


@pytest.mark.parametrize("kind", ["indexed", "sft"])
def test_an_idx_cut_under_a_ranks_reader_changes_no_row(stdlib_corpus, sft_corpus, tmp_path, kind):
    """The index is read when the rank opens the data (`IndexedFile`): an .idx cut later to
    1,000 bytes changes no row (a memory-mapped one kills its reader with SIGBUS beyond the
    first 4 KiB page and reads zeros in it)."""
    from ftrain.data.dataset import LOSS_MASK_SUFFIX

    cfg, data, reader = _reader(kind, stdlib_corpus, sft_corpus, tmp_path)
    want = {step: data.batch(step) for step in (2, 3, 4)}
    for suffix in ("", LOSS_MASK_SUFFIX) if kind == "sft" else ("",):
        os.truncate(cfg.data.path + suffix + ".idx", 1000)
    for step in (2, 3, 4):
        got = reader.batch(step, 1, 0)
        assert got.digest() == want[step].digest(), step  # tokens and masks


@pytest.mark.slow
def test_the_cli_stops_with_one_data_error_line_and_exit_2_when_the_bin_is_cut_mid_run(stdlib_corpus, tmp_path):
    """`main.py train` (a local Ray, 2 ranks and a spare) on a copy of the corpus whose .bin is
    truncated once step 1 is logged: exit 2, the last stderr line is the one `data error:`
    line, no traceback, no recovery, the spare still there (slow: a local Ray per run)."""
    import subprocess
    import sys

    tok, prefix = stdlib_corpus
    copy = _copy(prefix, str(tmp_path / "corpus"))
    args = ["train.objective=ce", "data.kind=indexed", f"data.path={copy}", f"data.tokenizer={tok}",
            "model.vocab_size=2048", f"run_dir={tmp_path}/run", f"checkpoint.uri={tmp_path}/ckpt",
            "cluster.num_workers=2", "cluster.num_spares=1", "train.steps=1000"]
    proc = subprocess.Popen([sys.executable, "main.py", "train", *(a for s in args for a in ("--set", s))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    stderr = []
    try:
        for line in proc.stderr:
            stderr.append(line)
            if "event=step step=1 " in line:
                os.truncate(copy + ".bin", 1000)
                break
        stderr += proc.stderr.readlines()
        stdout = proc.stdout.read()
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(stderr)
    assert code == 2 and "Traceback" not in text, text[-3000:]
    assert re.match(rf"data error: step \d+ row \d+ \(window \d+ of {re.escape(copy)}\): document \d+ of "
                    rf"{re.escape(copy)}\.bin: read [\d,]+ of [\d,]+ bytes", stderr[-1]), text[-3000:]
    assert "event=recovery" not in text and "recoveries:" not in stdout, text[-3000:]
    assert [line for line in stderr if "event=step " in line][-1].split(" spares=")[1].startswith("1 "), text[-3000:]
