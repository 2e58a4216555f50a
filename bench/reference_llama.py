"""The plain-PyTorch reference of the engine's training speed: a Hugging Face `LlamaForCausalLM`
of the config's shape, trained by the simplest loop that is fast on one device (what a user
would write without this project), eager or under `torch.compile`.

The loop: SDPA attention (`attn_implementation="sdpa"`), fp32 parameters under bf16 autocast
when `model.dtype` is bfloat16 on CUDA (fp32 otherwise), next-token cross entropy (HF's
`labels=` loss), gradient accumulation over micro-batches of `train.micro_batch_size`, fused
AdamW (`train.lr`, `train.weight_decay`) once per step; no clipping, no schedule, no
fault tolerance. The data: one batch of random tokens (seeded), every step (speed does not
depend on the values; the losses falling shows the loop trains).

Model FLOPs per token: flops.py with r = 0 (no old-log-prob pass: this loop has none), so
MFU = rows * seq_len * flops_per_token / (step_s * peak).

Run by bench/train_speed.py after its engine phases (the GPU is free again), once eager and
once compiled, each in a process of its own (`run_reference`); alone:
    python -m bench.reference_llama [--config config.yaml] [--set a.b=v ...] [--rows N]
        [--compile] [--steps 8] [--warmup 2] [--peak-tflops T] [--out FILE]
Prints one line and writes JSON: {"compiled", "device", "params", "rows", "tokens_per_step",
"flops_per_step", "step_s", "step_s_all", "tokens_per_s", "mfu", "peak_memory_gb", "losses"}
(step_s: median seconds per timed step; mfu and peak_memory_gb null on CPU / without a peak).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build_model(m, device):
    """`LlamaForCausalLM` of the sizes of `m` (a ModelConfig): kv heads = heads, untied
    embeddings, no dropout, SDPA attention; fp32 parameters on `device`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
                     num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
                     num_key_value_heads=m.num_heads, max_position_embeddings=m.max_seq_len,
                     attention_dropout=0.0, tie_word_embeddings=False, attn_implementation="sdpa")
    with torch.device(device):  # initialised where it trains (a 1B model's init on the CPU takes minutes)
        return LlamaForCausalLM(hf)


def train_speed(cfg, rows: int, compiled: bool, steps: int, warmup: int, peak: float | None) -> dict:
    """Time `warmup + steps` training steps of `rows` sequences of train.seq_len tokens each on
    this process's device (cuda:0 when cfg.cluster.device is cuda, else the CPU); returns the
    dict of the module docstring. Raises ValueError when rows is not a multiple of
    train.micro_batch_size."""
    import torch

    from ftrain.ops.flops import flops_per_token, matmul_params, total_params

    m, t = cfg.model, cfg.train
    micro = min(t.micro_batch_size, rows)
    if rows % micro:
        raise ValueError(f"--rows {rows} is not a multiple of train.micro_batch_size={micro}")
    cuda = cfg.cluster.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    torch.manual_seed(t.seed)
    model = build_model(m, device)
    params = sum(p.numel() for p in model.parameters())
    expected = total_params(m.num_layers, m.hidden_size, m.ffn_hidden_size, m.vocab_size)
    if params != expected:  # the FLOPs formula would not describe this model
        raise RuntimeError(f"the reference model has {params} parameters, flops.total_params {expected}")
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay, fused=True)
    step_fn = torch.compile(model) if compiled else model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda and m.dtype == "bfloat16")
    ids = torch.randint(0, m.vocab_size, (rows, t.seq_len), device=device,
                        generator=torch.Generator(device).manual_seed(t.seed))
    times, losses = [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss_sum = 0.0
        for mb in ids.split(micro):
            with autocast:
                loss = step_fn(input_ids=mb, labels=mb).loss * (micro / rows)
            loss.backward()
            loss_sum += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss_sum))  # note: a host sync, as any loop that logs its loss
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    per_token = flops_per_token(matmul_params(m.num_layers, m.hidden_size, m.ffn_hidden_size, m.vocab_size),
                                m.num_layers, m.hidden_size, t.seq_len, old_logprob_pass=False)
    tokens = rows * t.seq_len
    step_s = statistics.median(times)
    return {"compiled": compiled, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "params": params, "rows": rows, "micro_batch_size": micro, "tokens_per_step": tokens,
            "flops_per_step": per_token * tokens, "step_s": step_s, "step_s_all": times,
            "tokens_per_s": tokens / step_s, "mfu": per_token * tokens / (step_s * peak) if peak else None,
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None, "losses": losses}


def run_reference(config: str, overrides: list[str], rows: int, compiled: bool, steps: int, warmup: int,
                  peak_tflops: float | None, timeout_s: float = 1800.0) -> dict:
    """`train_speed` in a fresh Python process (`python -m bench.reference_llama`): its own CUDA
    context and compile caches, freed when it exits. Returns its JSON dict, or {"error": the
    last lines of its output} when it fails or runs past `timeout_s` (the engine's numbers are
    kept either way)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "reference.json"
        cmd = [sys.executable, "-m", "bench.reference_llama", "--config", config, "--rows", str(rows),
               "--steps", str(steps), "--warmup", str(warmup), "--out", str(out),
               *(["--compile"] if compiled else []), *(["--peak-tflops", str(peak_tflops)] if peak_tflops else []),
               *[a for o in overrides for a in ("--set", o)]]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout_s:g} s"}
        if proc.returncode != 0:
            return {"error": (proc.stdout + proc.stderr)[-2000:]}
        return json.loads(out.read_text())


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "config.yaml"))
    p.add_argument("--set", dest="overrides", action="append", default=[], help="config override a.b=value")
    p.add_argument("--rows", type=int, default=None,
                   help="sequences per step (default: train.global_batch_size, all on this device)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (default: eager)")
    p.add_argument("--steps", type=int, default=8, help="timed steps (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2; compilation)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s of the device for MFU (default 989 on cuda: H100/H200 dense bf16)")
    p.add_argument("--out", default=None, help="JSON path (default: none, print only)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1, --warmup >= 0")
    from ftrain.config import load_config, resolve

    cfg = resolve(load_config(args.config, args.overrides))
    cuda = cfg.cluster.device == "cuda"
    peak = args.peak_tflops * 1e12 if args.peak_tflops else (989e12 if cuda else None)
    r = train_speed(cfg, args.rows or cfg.train.global_batch_size, args.compile, args.steps, args.warmup, peak)
    mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
    print(f"reference {'compiled' if r['compiled'] else 'eager'} on {r['device']}: {r['step_s']:.4f} s/step, "
          f"{r['tokens_per_s']:,.0f} tokens/s, MFU {mfu}")
    if args.out:
        Path(args.out).write_text(json.dumps(r, indent=1))
    return r


if __name__ == "__main__":
    main()
