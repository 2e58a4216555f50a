"""Ranks read their own rows (rank_rows.py): the same bytes, loss weights and digests as the
driver-side read of the global batch at dp 1, 2 and 4, through the prefetch and after a rewind;
a whole step trained from rank reads is bitwise the step trained from the driver's batch (the
DP all-reduce of masked tokens included); a .bin truncated mid-run stops the run with one line
naming step, row and document, and spends no spare."""
import os
import pickle
import re
import shutil

import pytest
import torch

from data import open_data
from dispatch import MeshDispatch
from parallel_dims import ParallelDims
from ppo import step_loss_weights
from rank_rows import RankRows, global_digest
from test_data import data_cfg


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


def test_a_step_from_rank_reads_is_bitwise_the_step_from_the_driver_batch(ray_session, stdlib_corpus, tmp_path):
    from actor_group import ActorGroup
    from trainer import Trainer

    cfg = data_cfg(stdlib_corpus, "data.eod_mask_loss=true", tmp_path=tmp_path)  # dp=2, masks differ
    group = ActorGroup(cfg)
    try:
        trainer = Trainer(cfg, group)
        full = trainer.data.batch(1)
        full.loss_weights = step_loss_weights(full.loss_mask, cfg.train, "token-mean", 2)
        driver = group.call("train_step", 1, full, dispatch="mesh")
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
    from actor_group import ActorGroup
    from failures import DataError
    from trainer import Trainer

    tok, prefix = stdlib_corpus
    copy = str(tmp_path / "corpus")
    for ext in (".bin", ".idx"):
        shutil.copyfile(prefix + ext, copy + ext)
    cfg = data_cfg((tok, copy), "cluster.num_spares=1", tmp_path=tmp_path)
    group = ActorGroup(cfg)
    try:
        trainer = Trainer(cfg, group)
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
