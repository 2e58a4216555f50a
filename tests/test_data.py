"""The data module (data.py): the sample address is DP-invariant and prefix-stable, windows
equal megatron-core's own GPTDataset windows, blends follow their weights; the ce objective
trains on real text (the loss falls) and a peer recovery replays it bitwise."""
import types

import numpy as np
import pytest
import ray

from config import load_config, resolve
from data import Data, Windows, open_data


def data_cfg(corpus, *overrides, tmp_path="runs/test_data"):
    tok, prefix = corpus
    return resolve(load_config("config.yaml", [
        "cluster.num_workers=2", "cluster.num_spares=0", "checkpoint.interval=0",
        f"run_dir={tmp_path}", f"checkpoint.uri={tmp_path}/ckpt", "model.vocab_size=2048",
        "train.objective=ce", "data.kind=indexed", f"data.path={prefix}", f"data.tokenizer={tok}",
        *overrides]), num_gpus=0)


@pytest.fixture(scope="module")
def data(stdlib_corpus):
    return open_data(data_cfg(stdlib_corpus))


@pytest.fixture(scope="module")
def blend(stdlib_corpus):
    _, prefix = stdlib_corpus
    return open_data(data_cfg(stdlib_corpus, "data.path=null", f"data.blend=0.7 {prefix} 0.3 {prefix}",
                              "data.seed=7"))


@pytest.mark.parametrize("which", ["data", "blend"])
def test_replicas_interleave_to_the_global_batch_at_any_dp(which, request):
    d = request.getfixturevalue(which)
    epoch_end = len(d.windows[0]) // d.gbs + 1  # a step that crosses the first epoch's end
    for step in (1, 2, epoch_end):
        full = d.rows(step)
        for dp in (1, 2, 4, 8):
            parts = [d.rows(step, dp, r) for r in range(dp)]
            together = np.empty_like(full)
            for r, part in enumerate(parts):
                together[r::dp] = part
            assert (together == full).all(), (step, dp)


def test_the_order_does_not_depend_on_train_steps_or_the_blend_index_size(stdlib_corpus, blend):
    _, prefix = stdlib_corpus
    short = open_data(data_cfg(stdlib_corpus, "train.steps=1"))
    long = open_data(data_cfg(stdlib_corpus, "train.steps=100000"))
    assert all((short.rows(s) == long.rows(s)).all() for s in (1, 5, 900))
    # the blending index grows by doubling when a far step is asked first; its prefix is kept
    fresh = open_data(data_cfg(stdlib_corpus, "data.path=null", f"data.blend=0.7 {prefix} 0.3 {prefix}",
                               "data.seed=7"))
    far = fresh.addresses(100_000)
    assert len(fresh._blend[0]) > Data._BLEND_MIN
    assert [fresh.addresses(s) for s in (1, 2, 3)] == [blend.addresses(s) for s in (1, 2, 3)]
    assert far == blend.addresses(100_000)


def test_each_window_once_per_epoch(data):
    n = len(data.windows[0])
    seen = [w for s in range(1, n // data.gbs + 1) for _, _, e, w in data.addresses(s) if e == 0]
    assert len(seen) == len(set(seen)) == n // data.gbs * data.gbs


def test_blend_counts_follow_the_weights(blend):
    counts = np.zeros(2)
    for step in range(1, 201):
        for _, k, _, _ in blend.addresses(step):
            counts[k] += 1
        n = step * blend.gbs
        assert (np.abs(counts - blend.weights * n) <= 1).all(), (step, counts)


def test_windows_equal_megatron_gpt_dataset_windows(stdlib_corpus, data):
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import Split

    _, prefix = stdlib_corpus
    ours: Windows = data.windows[0]
    low, seq = ours.low, ours.seq_len
    cfg = GPTDatasetConfig(random_seed=data.seed, sequence_length=seq - 1, blend=([prefix], None),
                           split="100,0,0", reset_position_ids=False, reset_attention_mask=False,
                           eod_mask_loss=False, path_to_cache=None, mid_level_dataset_surplus=0.005,
                           tokenizer=types.SimpleNamespace(eod=data.eod_id, pad=0, vocab_size=2048,
                                                           unique_identifiers={"class": "fixture"}))
    theirs = GPTDataset(low, prefix, np.arange(len(low.sequence_lengths), dtype=np.int32), len(ours),
                        Split.train, cfg)
    assert len(theirs) == len(ours)
    assert (theirs.document_index == ours.document_index).all()
    assert (theirs.sample_index == ours.sample_index).all()
    position = np.argsort(theirs.shuffle_index)  # where GPTDataset serves window w
    for w in range(0, len(ours), 97):
        sample = theirs[int(position[w])]
        text = np.concatenate([sample["tokens"].numpy(), sample["labels"].numpy()[-1:]])
        assert (text == ours.window(w)).all(), w


def test_eod_mask_loss_masks_the_token_after_each_eod(stdlib_corpus, data):
    masked = open_data(data_cfg(stdlib_corpus, "data.eod_mask_loss=true"))
    for step in range(1, 40):
        a, b = data.batch(step), masked.batch(step)
        assert (a.input_ids == b.input_ids).all()
        after_eod = b.input_ids[:, :-1] == data.eod_id
        assert (b.loss_mask[:, 1:] == (~after_eod).float()).all() and (b.loss_mask[:, 0] == 0).all()
        if after_eod.any():
            return
    pytest.fail("no EOD in the first 40 steps")


def test_ce_loss_falls_on_real_text(ray_session, stdlib_corpus, tmp_path):
    from conftest import reference_run

    losses, _ = reference_run(data_cfg(stdlib_corpus, "train.steps=12", "train.lr=0.01",
                                       tmp_path=tmp_path), 12)
    assert abs(losses[1] - np.log(2048)) < 0.3, losses[1]  # uniform over the vocabulary at the start
    assert losses[12] < losses[1] - 1.5, losses


def test_ce_peer_recovery_matches_the_run_without_failure_bitwise(ray_session, stdlib_corpus, tmp_path, data):
    from actor_group import ActorGroup
    from conftest import reference_run
    from trainer import Trainer

    cfg = data_cfg(stdlib_corpus, "cluster.num_spares=1", tmp_path=tmp_path)
    ref_losses, ref_states = reference_run(cfg, 4)
    group = ActorGroup(cfg)
    try:
        trainer = Trainer(cfg, group, data=data)
        trainer.train(2)
        ray.kill(group.workers[1].handle, no_restart=True)
        trainer.train(4)
        states = group.state_digests()
    finally:
        group.shutdown()
    (tl,) = trainer.recoveries
    assert (tl.restore_source, tl.steps_lost) == ("peer", 0)
    assert trainer.losses == ref_losses
    assert states == ref_states
    assert trainer.data_digests == {s: data.batch(s).digest() for s in range(1, 5)}
