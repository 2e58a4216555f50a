"""The model-FLOPs formula (flops.py) against hand-computed values and the Megatron-LM paper's
closed form, and a short CPU run of bench/train_speed.py (torch engine, 2 workers, a few steps)
whose JSON must be complete and sane, with the parameter formula equal to the live model's count."""
import json
import math

import pytest

from ftrain.ops import flops

from conftest import run_bench


def test_flops_by_hand():
    # config.yaml's model: L=2, h=64, f=128, V=128; s=32, global batch 16.
    n = flops.matmul_params(2, 64, 128, 128)
    assert n == 2 * (4 * 64 * 64 + 3 * 64 * 128) + 64 * 128 == 90_112
    per_token = flops.flops_per_token(n, 2, 64, 32)
    assert per_token == 8 * 90_112 + 16 * 2 * 64 * 32 == 786_432
    assert per_token * 16 * 32 == 402_653_184
    assert flops.flops_per_token(n, 2, 64, 32, old_logprob_pass=False) == 6 * 90_112 + 12 * 2 * 64 * 32
    assert flops.total_params(2, 64, 128, 128) == 98_624
    # The ~1B GPU model: 24 layers, h 2048, f 5632, V 32000 (a multiple of 128: no padding), s 2048.
    n = flops.matmul_params(24, 2048, 5632, 32000)
    assert n == 1_298_661_376
    assert flops.total_params(24, 2048, 5632, 32000) == 1_364_297_728
    assert flops.flops_per_token(n, 24, 2048, 2048) == 11_999_903_744


def test_flops_is_narayanan_without_recomputation():
    """Plain MLP of 4h, no extra forward pass: Narayanan et al. 2021's 96 B s L h^2 (1 + s/6h +
    V/16Lh) minus the recomputed forward = 72 B s L h^2 (1 + s/6h + V/12Lh)."""
    L, h, s, V, B = 24, 2048, 2048, 51200, 8
    n = flops.matmul_params(L, h, 4 * h, V, mlp_matrices=2)
    f = flops.flops_per_token(n, L, h, s, old_logprob_pass=False) * B * s
    assert math.isclose(f, 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h)), rel_tol=1e-12)


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_bench_runs_on_cpu(tmp_path, stdlib_corpus):
    """One short CPU run (torch engine, dp=2) of issue 37's speed case: `ce` on the stdlib corpus
    (rows read from the `.bin` every step), one optimizer update per step: the JSON is complete
    and sane, no old-log-prob pass is counted, the parameter formula equals the live model's
    count, and the eager plain-PyTorch reference of the same shape trains."""
    tok, prefix = stdlib_corpus
    out = tmp_path / "train_speed.json"
    run_bench("train_speed", "--steps", "2", "--warmup", "1", "--out", str(out), "--reference", "eager",
              "--set", "cluster.device=cpu", "--set", "cluster.num_workers=2", "--set", "cluster.num_spares=0",
              "--set", "model.vocab_size=2048", "--set", "train.objective=ce", "--set", "train.mini_batch_size=16",
              "--set", "data.kind=indexed", "--set", f"data.path={prefix}", "--set", f"data.tokenizer={tok}")
    r = json.loads(out.read_text())
    for key in ("device", "engine", "layout", "params", "tokens_per_step", "off", "on",
                "overhead_ratio", "config"):
        assert key in r, key
    assert r["device"] == "cpu" and r["engine"] == "torch"
    assert r["layout"]["dp"] == 2 and r["layout"]["gpus"] == 0
    assert r["objective"] == "ce" and r["data_kind"] == "indexed"
    assert r["updates_per_step"] == 1 and r["old_logprob_pass"] is False
    n = flops.matmul_params(2, 64, 128, 2048)
    assert r["params"] == r["params_live"] == n + 2048 * 64 + 5 * 64  # + the input embedding and the norms
    assert r["tokens_per_step"] == 16 * 32
    assert r["flops_per_step"] == flops.flops_per_token(n, 2, 64, 32, old_logprob_pass=False) * 16 * 32
    for name in ("off", "on_no_memory", "on"):
        ph = r[name]
        assert ph["timed_steps"] == 2 and ph["stopped_early"] is None, name
        assert positive(ph["step_s"]) and positive(ph["tokens_per_s"]), name
        assert math.isclose(ph["tokens_per_s"], r["tokens_per_step"] / ph["step_s"])
        assert ph["mfu"] is None  # CPU: no peak FLOP/s known
    assert positive(r["overhead_ratio"]) and positive(r["overhead_ratio_no_memory"])
    assert r["losses_equal"]  # the same steps in every phase, bitwise on CPU
    assert r["on"]["recoveries"] == 0 and r["on"]["snapshot_lag_s"] >= 0
    assert all(v >= 0 for v in r["components"].values())
    # memory snapshots every step: each of the 3 ON steps x 2 ranks sent or skipped, none failed
    m = r["memory_snapshots"]
    assert m["sent"] >= 1 and m["sent"] + m["skipped"] == 3 * 2 and m["failed"] == 0, m
    assert positive(r["memory_snapshot_every_step_ratio"]) and positive(r["state_gb"])
    assert r["async_save_stall_s"] is None and r["save_vs_raw"] is None  # no checkpoints here
    # the plain-PyTorch reference of the same shape, one device's share of the batch (CPU: all of it)
    assert r["mfu"] is None and r["reference_eager_mfu"] is None and r["reference_compiled_mfu"] is None
    assert r["tokens_per_s_vs_compiled"] is None  # no compiled reference asked for (CPU)
    ref = r["reference"]["eager"]
    assert set(r["reference"]) == {"eager"} and not ref["compiled"]
    assert ref["params"] == r["params"] and ref["rows"] == 16 and ref["tokens_per_step"] == 16 * 32
    assert len(ref["step_s_all"]) == 2 and positive(ref["tokens_per_s"])
    assert all(math.isfinite(x) for x in ref["losses"]) and ref["losses"][-1] < ref["losses"][0]  # it trains
    assert math.isclose(r["tokens_per_s_per_gpu_vs_reference"]["eager"],
                        r["off"]["tokens_per_s"] / ref["tokens_per_s"])


@pytest.mark.slow
def test_bench_one_update_ppo_on_cpu(tmp_path):
    """The other issue-37 speed case on CPU: one-update PPO on synthetic batches counts no
    old-log-prob pass."""
    out = tmp_path / "train_speed.json"
    run_bench("train_speed", "--steps", "1", "--warmup", "1", "--out", str(out), "--reference", "none",
              "--no-components", "--set", "cluster.device=cpu", "--set", "cluster.num_workers=1",
              "--set", "cluster.num_spares=0", "--set", "fault_tolerance.memory_snapshot_interval=0",
              "--set", "train.objective=ppo", "--set", "train.mini_batch_size=16")
    r = json.loads(out.read_text())
    assert r["objective"] == "ppo" and r["data_kind"] == "synthetic"
    assert r["updates_per_step"] == 1 and r["old_logprob_pass"] is False
    assert r["losses_equal"] and positive(r["off"]["tokens_per_s"])


@pytest.mark.slow
def test_compiled_reference_on_cpu(tmp_path):
    """bench/reference_llama.py under torch.compile (inductor on CPU: about half a minute)."""
    out = tmp_path / "ref.json"
    run_bench("reference_llama", "--compile", "--steps", "2", "--warmup", "1", "--out", str(out),
              "--set", "cluster.device=cpu", "--set", "model.dtype=float32")
    r = json.loads(out.read_text())
    assert r["compiled"] and r["params"] == 98_624 and r["mfu"] is None
    assert positive(r["tokens_per_s"]) and r["losses"][-1] < r["losses"][0]


def test_profile_step_runs_on_cpu(tmp_path):
    """bench/profile_step.py on the torch engine: the tables add up and the trace is written."""
    run_bench("profile_step", "--steps", "1", "--warmup", "1", "--top", "5", "--out-dir", str(tmp_path),
              "--set", "cluster.device=cpu")
    r = json.loads((tmp_path / "profile_step_cpu.json").read_text())
    assert r["engine"] == "torch" and r["time_basis"] == "cpu" and len(r["top"]) == 5
    assert math.isclose(sum(r["shares"].values()), 1.0) and r["shares"]["matmul"] > 0
    assert all(row["category"] in r["shares"] for row in r["top"])
    assert positive(r["total_s_per_step"]) and r["host_syncs"]["count_per_step"] > 0  # the loss's .item()
    assert (tmp_path / "profile_step_cpu.trace.json.gz").stat().st_size > 0
