"""PPO on real experience, CPU: the reward curve of `configs/ppo_cpu.yaml`, and the same run with
two injected failures (`chaos.events`, kill on a rank), which must end with the same curve.

Each run: `Trainer.train` over a `ActorGroup` (real Ray actors, gloo), every step a
rollout (the policy samples its own completions), exact rewards, GRPO advantages and PPO
updates. The run with failures recovers from spares (peer restore) and re-runs the step in
flight, rollout included; sampling is a pure function of (seed, step, row) and the weights, so
its rewards and losses must equal the run without failure at every step, bitwise.

Usage (repository root): python -m bench.ppo_cpu [--config configs/ppo_cpu.yaml] [--set a.b=v ...]
Prints a table and writes bench/results/ppo_cpu.json: {"reward_start", "reward_end" (means over
the first / last `--window` steps), "steps", "failures", "curve_equal_to_no_failure",
"curves": {"no_failure", "with_failures"}, "losses_equal", "recoveries", "seconds", "config"}
and bench/results/ppo_cpu.png (reward per step of both runs, recoveries marked).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from checkpoint import CheckpointManager
from ftrain.config import load_config, resolve
from ftrain.control.actor_group import ActorGroup
from ftrain.distributed.parallel_dims import ParallelDims
from ftrain.trainer import Trainer
from main import start_ray
from megatron_actor import MegatronActor

ROOT = Path(__file__).resolve().parent.parent


def failures(steps: int) -> list[dict]:
    """The two injected kills, at 1/3 and 11/15 of the run (steps 100 and 220 of the preset's 300)."""
    return [{"step": steps // 3, "rank": 1, "kind": "kill", "point": "step_start"},
            {"step": steps * 11 // 15, "rank": 0, "kind": "kill", "point": "inside_allreduce"}]


def run(cfg) -> dict:
    """Train `cfg` for train.steps steps; returns rewards, losses, recoveries and seconds."""
    t0 = time.perf_counter()
    group = ActorGroup(MegatronActor, cfg)
    try:
        trainer = Trainer(cfg, group, CheckpointManager.from_config(cfg.checkpoint))
        trainer.train(cfg.train.steps)
    finally:
        group.shutdown()
    return {"rewards": trainer.rewards, "losses": trainer.losses, "exact": {
        s: st["exact"] for s, st in trainer.rollout_stats.items()},
        "replayed_rewards": trainer.replayed_rewards,
        "recoveries": [t.to_dict() for t in trainer.recoveries], "seconds": time.perf_counter() - t0}


def mean(xs) -> float:
    return sum(xs) / len(xs)


def plot(path: Path, ref: dict, run_: dict, window: int) -> Path:
    """Reward per step of both runs (thin), their moving averages over `window` steps (thick),
    each recovery as a dashed red line at the step re-run after it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, curve, style in (("no failure", ref["rewards"], "-"),
                               ("two failures", run_["rewards"], "--")):
        steps = sorted(curve)
        ys = [curve[s] for s in steps]
        line, = ax.plot(steps, ys, style, alpha=0.3, linewidth=1)
        avg = [mean(ys[max(0, i - window + 1):i + 1]) for i in range(len(ys))]
        ax.plot(steps, avg, style, color=line.get_color(), linewidth=2,
                label=f"{name} ({window}-step mean)")
    for i, tl in enumerate(run_["recoveries"]):
        ax.axvline(tl["committed_step"] + 1, color="red", linestyle="--", alpha=0.7,
                   label="recovery" if i == 0 else None)
        ax.annotate(f"{tl['kind']} r{','.join(map(str, tl['failed_ranks']))}\n{tl['total_s']:.2f} s",
                    (tl["committed_step"] + 1, 0.98), xycoords=("data", "axes fraction"),
                    xytext=(3, -3), textcoords="offset points", va="top", fontsize=8, color="red")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward of the step's samples")
    ax.set_ylim(0, 1.1)
    ax.set_title("PPO (GRPO) on the copy task, CPU: reward per step, with and without failures")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs" / "ppo_cpu.yaml"))
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--window", type=int, default=20, help="steps averaged for reward_start / reward_end")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "ppo_cpu.json"))
    args = p.parse_args(argv)
    tmp = f"/tmp/bench_ppo_{int(time.time())}"

    def cfg_for(name, events):
        return resolve(load_config(args.config, [f"run_dir={tmp}/{name}", f"checkpoint.uri={tmp}/{name}/ckpt",
                                                 *args.overrides, f"chaos.events={json.dumps(events)}"]))

    ref_cfg = cfg_for("no_failure", [])
    start_ray(ref_cfg)
    ref = run(ref_cfg)
    steps, w = ref_cfg.train.steps, args.window
    run_ = run(cfg_for("with_failures", failures(steps)))
    curve = [ref["rewards"][s] for s in sorted(ref["rewards"])]
    equal = run_["rewards"] == ref["rewards"]
    result = {
        "reward_start": mean(curve[:w]), "reward_end": mean(curve[-w:]),
        "exact_start": mean([ref["exact"][s] for s in sorted(ref["exact"])][:w]),
        "exact_end": mean([ref["exact"][s] for s in sorted(ref["exact"])][-w:]),
        "steps": steps, "failures": failures(steps), "curve_equal_to_no_failure": equal,
        "losses_equal": run_["losses"] == ref["losses"],
        "replays_equal": all(v == [ref["rewards"][s]] * len(v) for s, v in run_["replayed_rewards"].items()),
        "seconds": {"no_failure": ref["seconds"], "with_failures": run_["seconds"]},
        "recoveries": run_["recoveries"],
        "curves": {"no_failure": ref["rewards"], "with_failures": run_["rewards"]},
        "config": {"file": str(Path(args.config).relative_to(ROOT)) if Path(args.config).is_relative_to(ROOT)
                   else args.config, "overrides": args.overrides, "task": ref_cfg.rl.task,
                   "task_args": ref_cfg.rl.task_args, "advantage": ref_cfg.rl.advantage,
                   "workers": ref_cfg.cluster.num_workers, "spares": ref_cfg.cluster.num_spares,
                   "dp": ParallelDims.from_config(ref_cfg).dp, "window": w, "date": time.strftime("%Y-%m-%d")},
    }
    print(f"\n{'run':<16}{'reward first ' + str(w):>18}{'reward last ' + str(w):>17}{'exact last ' + str(w):>16}"
          f"{'recoveries':>12}{'seconds':>10}")
    for name, r in (("no failure", ref), ("two failures", run_)):
        c = [r["rewards"][s] for s in sorted(r["rewards"])]
        e = [r["exact"][s] for s in sorted(r["exact"])]
        print(f"{name:<16}{mean(c[:w]):>18.3f}{mean(c[-w:]):>17.3f}{mean(e[-w:]):>16.3f}"
              f"{len(r['recoveries']):>12}{r['seconds']:>10.1f}")
    print(f"reward curve equal to the run without failure (every step, bitwise): {'yes' if equal else 'NO'}; "
          f"losses equal: {'yes' if result['losses_equal'] else 'NO'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out} and {plot(out.with_suffix('.png'), ref, run_, w)}")
    return result


if __name__ == "__main__":
    main()
