"""End-of-run plots (matplotlib, Agg backend: no display needed), written to the run directory.

- `loss.png`: loss over steps, one line per series (the demo draws its reference run too),
  replays of committed steps as dots, and each recovery as a dashed vertical line at the step
  that was in flight when the failure hit. `reward.png` (RL runs): the same for mean reward.
- `recoveries.png`: one stacked horizontal bar per recovery, one segment per phase (seconds).
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from ftrain.failures import RecoveryTimeline  # noqa: E402

PHASES = RecoveryTimeline.PHASES


def plot_loss(path: str | Path, series: dict[str, dict[int, float]], recoveries: list[dict],
              replayed: dict[int, list[float]] | None = None, quantity: str = "loss") -> Path:
    """Write the per-step plot of `quantity` (loss, reward) to `path`. `series`: name ->
    {step: value}; `recoveries`: timelines as dicts (`RecoveryTimeline.to_dict()`); `replayed`:
    step -> values of re-runs. Returns `path`."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for (name, losses), style in zip(series.items(), ("-", "--", ":", "-.")):
        steps = sorted(losses)
        ax.plot(steps, [losses[s] for s in steps], style, marker="o", markersize=3, label=name)
    if replayed:
        xs = [s for s, ls in replayed.items() for _ in ls]
        ax.scatter(xs, [v for ls in replayed.values() for v in ls], marker="x", color="black",
                   zorder=3, label="replayed step")
    for i, tl in enumerate(recoveries):
        ax.axvline(tl["committed_step"] + 1, color="red", linestyle="--", alpha=0.7,
                   label="recovery" if i == 0 else None)
        ax.annotate(f"{tl['kind']} r{','.join(map(str, tl['failed_ranks']))}\n{tl['total_s']:.2f} s",
                    (tl["committed_step"] + 1, 1), xycoords=("data", "axes fraction"),
                    xytext=(3, -3), textcoords="offset points", va="top", fontsize=8, color="red")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel(quantity)
    ax.set_title(f"{quantity} per step (dashed: recovery before the step was re-run)")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_recoveries(path: str | Path, recoveries: list[dict]) -> Path:
    """Write one stacked horizontal bar per recovery (phases in seconds) to `path`."""
    fig, ax = plt.subplots(figsize=(8, 1.5 + 0.6 * max(1, len(recoveries))))
    labels = [f"#{i + 1} {tl['kind']} ranks {tl['failed_ranks']} (step {tl['committed_step'] + 1})"
              for i, tl in enumerate(recoveries)]
    left = [0.0] * len(recoveries)
    for phase in PHASES:
        widths = [tl[phase] for tl in recoveries]
        ax.barh(labels, widths, left=left, label=phase[:-2])
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title("recovery timeline" if recoveries else "recovery timeline (no recovery)")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _save(fig, path)


def _save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
