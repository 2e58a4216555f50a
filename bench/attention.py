"""Core attention of the local layer spec, side by side in one process on one GPU: Megatron's
`DotProductAttention` (materialises the [b, heads, s, s] scores) against `SDPAttention`
(torch's fused scaled_dot_product_attention), in the same GPTModel with the same weights.

For each: the median seconds of a forward + backward of one micro-batch (after warm-up), the
peak GPU memory of that pass, and the model-FLOPs utilisation of the pass (`flops.flops_per_token`
x tokens / time / peak, without the old-log-prob pass). The logits of the two are compared
(bf16: within `main.losses_match`'s relative tolerance on the mean absolute logit).

Usage (repository root, a GPU machine): python -m bench.attention [--micro-batch 2] [--repeats 10]
    [--peak-tflops 989] [--out FILE] [--set a.b=v ...]   (default shape: the 1.36B model)
Prints a table and writes JSON (default bench/results/gpu/attention_<gpu>.json):
{"device", "params", "tokens", "local": {...}, "sdpa": {...}, "speedup", "logits_rel_diff", "config"}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

MODEL_1B = ["model.num_layers=24", "model.hidden_size=2048", "model.num_heads=16", "model.ffn_hidden_size=5632",
            "model.vocab_size=32000", "model.max_seq_len=2048", "train.seq_len=2048"]
ROOT = Path(__file__).resolve().parent.parent


def measure(cfg, sdpa: bool, ids, repeats: int) -> tuple[dict, object]:
    """Build the model (seeded: the same weights for both), time `repeats` forward + backward
    passes after 2 warm-up ones; returns (numbers, logits of the first pass)."""
    import torch
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    from ftrain.engines.megatron_model import build_gpt_model

    torch.manual_seed(cfg.train.seed)
    model_parallel_cuda_manual_seed(cfg.train.seed)
    model, tc = build_gpt_model(cfg, 1, 1, 1, sdpa=sdpa)
    model = Float16Module(tc, model.cuda()) if tc.bf16 else model.cuda()
    pos = torch.arange(ids.shape[1], device="cuda").expand_as(ids)
    times, logits = [], None
    torch.cuda.reset_peak_memory_stats()
    for i in range(2 + repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(ids, pos, None)
        out.float().square().mean().backward()
        torch.cuda.synchronize()
        if i == 0:
            logits = out.detach().float()
        if i >= 2:
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    numbers = {"fwd_bwd_s": statistics.median(times), "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9}
    del model, out
    torch.cuda.empty_cache()
    return numbers, logits


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak (H200: 989)")
    p.add_argument("--out", default=None)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args(argv)
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from ftrain.config import load_config, resolve
    from ftrain.ops.flops import flops_per_token, matmul_params

    cfg = resolve(load_config(None, [*MODEL_1B, "cluster.num_workers=1", "cluster.num_spares=0", *args.overrides]))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    ps.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    m, s = cfg.model, cfg.train.seq_len
    ids = torch.randint(0, m.vocab_size, (args.micro_batch, s), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    n = matmul_params(m.num_layers, m.hidden_size, m.ffn_hidden_size, m.vocab_size)
    flops = flops_per_token(n, m.num_layers, m.hidden_size, s, old_logprob_pass=False) * ids.numel()
    result = {"device": torch.cuda.get_device_name(0), "tokens": ids.numel(), "flops_per_pass": flops}
    logits = {}
    for name, sdpa in (("local", False), ("sdpa", True)):
        numbers, logits[name] = measure(cfg, sdpa, ids, args.repeats)
        numbers["tokens_per_s"] = ids.numel() / numbers["fwd_bwd_s"]
        numbers["mfu"] = flops / numbers["fwd_bwd_s"] / (args.peak_tflops * 1e12)
        result[name] = numbers
    result["speedup"] = result["local"]["fwd_bwd_s"] / result["sdpa"]["fwd_bwd_s"]
    result["logits_rel_diff"] = ((logits["sdpa"] - logits["local"]).abs().mean() / logits["local"].abs().mean()).item()
    result["config"] = {"micro_batch": args.micro_batch, "seq_len": s, "repeats": args.repeats,
                        "peak_tflops": args.peak_tflops, "model": {k: getattr(m, k) for k in (
                            "num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "vocab_size", "dtype")},
                        "date": time.strftime("%Y-%m-%d")}
    print(f"\n{'attention':<10}{'fwd+bwd s':>11}{'tokens/s':>11}{'MFU':>8}{'peak GB':>9}")
    for name in ("local", "sdpa"):
        r = result[name]
        print(f"{name:<10}{r['fwd_bwd_s']:>11.4f}{r['tokens_per_s']:>11.0f}{r['mfu']:>8.1%}{r['peak_memory_gb']:>9.1f}")
    print(f"speedup {result['speedup']:.2f}x; mean |logit difference| / mean |logit| {result['logits_rel_diff']:.2e}")
    out = Path(args.out or ROOT / "bench" / "results" / "gpu" /
               f"attention_{result['device'].replace(' ', '_').lower()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
