"""The failure process of the goodput bench (`python -m bench.goodput`) and the restart baseline
it is compared with: pure functions, no project state. A seeded Poisson process of failures
(`failure_schedule`: kinds by the weights of a mix, points where each kind strikes, ranks), and
the ETTR of a job that restarts from its newest checkpoint at each of them (`restart_ettr`).
"""
from __future__ import annotations

import math
import random

STEP_POINTS = ("step_start", "before_allreduce", "inside_allreduce", "after_optimizer_step")
# Where each kind may strike: `now`, or a point of config.CHAOS_POINTS that every run reaches
# (a crash `now` lands inside a save, a restore or a recovery whenever one is under way).
POINTS = {
    "crash": ("now", *STEP_POINTS, "during_save", "mid_save"),
    "exception": (*STEP_POINTS, "during_save", "mid_save"),
    "hang": STEP_POINTS,
    "node": ("now",),
}
MIX = "crash=0.4,exception=0.4,hang=0.2"  # the field's mix: crashes and exceptions 80 %, hangs 20 %


def parse_mix(text: str, nodes: int) -> dict[str, float]:
    """`kind=weight,...` -> {kind: weight}. Raises ValueError naming the flag for an unknown
    kind, a negative or all-zero weight, or `node` on one node."""
    mix = {}
    for part in filter(None, text.split(",")):
        kind, _, w = part.partition("=")
        if kind not in POINTS:
            raise ValueError(f"--mix: unknown kind {kind!r} (one of {', '.join(POINTS)})")
        mix[kind] = float(w)
        if mix[kind] < 0:
            raise ValueError(f"--mix: weight of {kind} must be >= 0")
    if mix.get("node") and nodes < 2:
        raise ValueError("--mix: node loss needs --nodes >= 2")
    if not sum(mix.values()) > 0:
        raise ValueError("--mix: give at least one kind a positive weight")
    return mix


def failure_schedule(mtbf_s: float, seed: int, horizon_s: float, mix: dict[str, float], world: int) -> list[dict]:
    """The failures of a Poisson process of mean inter-arrival `mtbf_s` seconds over
    [0, horizon_s), from `seed`: [{t_s, kind, point, rank}] in time order; kind drawn by the
    weights of `mix`, point uniformly from POINTS[kind], rank uniformly from range(world)."""
    rng = random.Random(seed)
    kinds, weights = zip(*mix.items())
    out, t = [], 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        if t >= horizon_s:
            return out
        kind = rng.choices(kinds, weights)[0]
        out.append({"t_s": round(t, 3), "kind": kind, "point": rng.choice(POINTS[kind]), "rank": rng.randrange(world)})


def restart_ettr(failures: list[tuple[float, float]], steps: int, step_s: float, interval: int,
                 restart_s: float) -> tuple[float, list[float]]:
    """ETTR of a job that restarts from its newest checkpoint at each failure: `failures` are
    (time in seconds from the start, seconds to detect it); the job trains `steps` steps of
    `step_s` seconds, commits a checkpoint every `interval` steps (0: never; a restart then
    begins at step 0), and a restart takes `restart_s` seconds to its first step. A failure
    during a restart starts it again. Returns (ETTR, steps lost at each failure that struck
    the job, fractions of the step in flight included)."""
    t, done, lost = 0.0, 0.0, []
    for at, detect_s in sorted(failures):
        if t + (steps - done) * step_s <= at:
            break  # the job ended first
        if at >= t:
            done += (at - t) / step_s
            kept = math.floor(done / interval) * interval if interval else 0
            lost.append(done - kept)
            done = kept
        t = at + detect_s + restart_s
    wall = t + (steps - done) * step_s
    return steps * step_s / wall, lost
