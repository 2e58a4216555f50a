import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ftrain.data.training_batch import TrainingBatch, synthetic_batch


def assert_batches_equal(a: TrainingBatch, b: TrainingBatch) -> None:
    for name in ("input_ids", "attention_mask", "loss_mask", "advantages", "old_log_probs"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), name


def make_batch(b=4, s=6, vocab=10, old=True) -> TrainingBatch:
    batch = synthetic_batch(seed=0, step=0, batch_size=b, seq_len=s, vocab_size=vocab)
    return batch.with_old_log_probs(-torch.rand(b, s)) if old else batch


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 4),
    per=st.integers(1, 3),
    s=st.integers(2, 8),
    old=st.booleans(),
    step=st.integers(0, 99),
)
def test_chunk_concat_round_trip(n, per, s, old, step):
    batch = synthetic_batch(seed=1, step=step, batch_size=n * per, seq_len=s, vocab_size=7)
    if old:
        batch = batch.with_old_log_probs(torch.randn(n * per, s))
    parts = batch.chunk(n)
    assert [len(p) for p in parts] == [per] * n
    # Chunks are in order: chunk i holds sequences [i*per, (i+1)*per).
    for i, p in enumerate(parts):
        assert torch.equal(p.input_ids, batch.input_ids[i * per:(i + 1) * per])
    assert_batches_equal(TrainingBatch.concat(parts), batch)


def test_chunk_not_divisible_names_sizes():
    with pytest.raises(ValueError, match="6 sequences into 4"):
        make_batch(b=6).chunk(4)


def test_concat_errors():
    with pytest.raises(ValueError):
        TrainingBatch.concat([])
    with pytest.raises(ValueError, match="old_log_probs"):
        TrainingBatch.concat([make_batch(old=True), make_batch(old=False)])


def test_slice_to_and_with_old_log_probs():
    batch = make_batch(b=4, old=False)
    part = batch.slice(1, 3)
    assert len(part) == 2 and torch.equal(part.advantages, batch.advantages[1:3])
    assert part.old_log_probs is None
    moved = batch.to("meta")
    fields = [f.name for f in dataclasses.fields(batch) if isinstance(getattr(batch, f.name), torch.Tensor)]
    assert fields and moved.old_log_probs is None
    for name in fields:
        a, b = getattr(moved, name), getattr(batch, name)
        assert (a.device.type, a.dtype, a.shape) == ("meta", b.dtype, b.shape), name
    old = torch.zeros(4, 6)
    with_old = batch.with_old_log_probs(old)
    assert with_old.old_log_probs is old and batch.old_log_probs is None


def test_validate_accepts_good_batch():
    make_batch().validate(vocab_size=10)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("attention_mask", torch.ones(4, 5, dtype=torch.int64), "attention_mask has shape"),
        ("loss_mask", torch.zeros(4, 6, dtype=torch.int64), "loss_mask must be torch.float32"),
        ("input_ids", torch.zeros(4, 6, dtype=torch.int32), "input_ids must be torch.int64"),
        ("advantages", torch.full((4, 6), float("nan")), "advantages contains NaN"),
        ("old_log_probs", torch.full((4, 6), float("nan")), "old_log_probs contains NaN"),
        ("input_ids", torch.zeros(0, 6, dtype=torch.int64), "empty batch"),
        ("input_ids", torch.zeros(6, dtype=torch.int64), r"input_ids must be \[B, S\]"),
        ("loss_mask", torch.ones(4, 6), "column 0"),
    ],
)
def test_validate_errors_name_field(field, value, match):
    batch = make_batch()
    setattr(batch, field, value)
    with pytest.raises(ValueError, match=match):
        batch.validate()


def test_validate_vocab_range():
    batch = make_batch()
    batch.input_ids[0, 0] = 10
    batch.validate()  # no vocab given: not checked
    with pytest.raises(ValueError, match="input_ids range"):
        batch.validate(vocab_size=10)
    batch.input_ids[0, 0] = -1
    with pytest.raises(ValueError, match="input_ids range"):
        batch.validate(vocab_size=10)


def test_synthetic_batch_is_pure_function_of_seed_and_step():
    state = torch.get_rng_state()
    a = synthetic_batch(seed=3, step=5, batch_size=8, seq_len=16, vocab_size=50)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(1234)  # the global RNG must not matter
    torch.rand(10)
    b = synthetic_batch(seed=3, step=5, batch_size=8, seq_len=16, vocab_size=50)
    assert_batches_equal(a, b)
    c = synthetic_batch(seed=3, step=6, batch_size=8, seq_len=16, vocab_size=50)
    d = synthetic_batch(seed=4, step=5, batch_size=8, seq_len=16, vocab_size=50)
    assert not torch.equal(a.input_ids, c.input_ids)
    assert not torch.equal(a.input_ids, d.input_ids)


def test_synthetic_batch_structure():
    b, s, p = 64, 12, 4
    batch = synthetic_batch(seed=0, step=0, batch_size=b, seq_len=s, vocab_size=30, prompt_len=p)
    batch.validate(vocab_size=30)
    assert batch.old_log_probs is None
    assert (batch.loss_mask[:, :p] == 0).all() and (batch.attention_mask[:, :p] == 1).all()
    response_len = batch.loss_mask.sum(dim=1).long()
    assert response_len.min() >= 1 and response_len.max() <= s - p
    assert len(set(response_len.tolist())) > 1  # random lengths
    for i in range(b):
        n = p + response_len[i].item()
        assert (batch.loss_mask[i, p:n] == 1).all() and (batch.loss_mask[i, n:] == 0).all()
        assert (batch.attention_mask[i, :n] == 1).all() and (batch.attention_mask[i, n:] == 0).all()
        # One advantage per sequence over its response, 0 elsewhere.
        adv = batch.advantages[i]
        assert (adv[p:n] == adv[p]).all() and (adv[:p] == 0).all() and (adv[n:] == 0).all()
    per_seq = batch.advantages[:, p]
    assert per_seq.std() > 0.5 and per_seq.abs().mean() < 1.5


def test_synthetic_batch_bad_args():
    with pytest.raises(ValueError, match="prompt_len"):
        synthetic_batch(seed=0, step=0, batch_size=2, seq_len=4, vocab_size=5, prompt_len=4)
    with pytest.raises(ValueError, match="prompt_len"):
        synthetic_batch(seed=0, step=0, batch_size=2, seq_len=4, vocab_size=5, prompt_len=0)


def test_a_batch_travels_as_numpy_and_comes_back_bitwise(ray_session):
    """Task arguments carry a TrainingBatch as numpy arrays (the fast path for Ray); through a
    real Ray object it comes back bitwise, with dtypes, None fields and writability intact.
    A batch numpy cannot hold (bf16) still travels, as tensors."""
    import pickle

    import numpy as np
    import ray

    b = synthetic_batch(3, 7, 8, 6, 50).with_old_log_probs(torch.randn(8, 6))
    _, args = b.__reduce__()
    assert all(a is None or isinstance(a, np.ndarray) for a in args)
    for back in (ray.get(ray.put(b)), pickle.loads(pickle.dumps(b, protocol=5))):
        for f in ("input_ids", "attention_mask", "loss_mask", "advantages", "old_log_probs"):
            assert getattr(back, f).dtype == getattr(b, f).dtype
            assert torch.equal(getattr(back, f), getattr(b, f)), f
        assert back.returns is None and back.old_values is None and back.ref_log_probs is None
        back.advantages += 1  # writable (Ray hands numpy buffers over read-only)
    bf = b.with_old_log_probs(b.old_log_probs.to(torch.bfloat16))
    assert torch.equal(ray.get(ray.put(bf)).old_log_probs, bf.old_log_probs)


def test_digest_names_the_tokens_and_the_mask():
    from ftrain.data.training_batch import synthetic_batch

    a, b = synthetic_batch(1, 1, 4, 8, 50), synthetic_batch(1, 1, 4, 8, 50)
    assert a.digest() == b.digest() and len(a.digest()) == 64
    b.loss_mask[0, -1] = 1 - b.loss_mask[0, -1]
    assert a.digest() != b.digest()
    assert a.digest() != synthetic_batch(1, 2, 4, 8, 50).digest()
