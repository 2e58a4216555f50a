"""Capacity planner: a discrete-event simulation of a long training job on G GPUs with failures.

It compares three recovery strategies on the *same* failure trace:
- `restart`: full job restart from the last persistent checkpoint (what a job without in-job
  fault tolerance does: tear down, reschedule, re-initialise, load the checkpoint; the work since
  that checkpoint is lost).
- `spare_ckpt`: hot spares replace the failed ranks in place, every rank reloads the newest
  checkpoint (the approach of the original example): no reschedule, but the work since the
  checkpoint is lost.
- `spare_peer` (ours): hot spares + peer / in-memory restore: the committed step survives, only
  the step in flight is re-run.
A strategy that needs spares and finds the pool empty waits for the refill (`--refill-h`), or
restarts the whole job when that is faster.

Useful work, not only uptime: each strategy's goodput (the fraction of GPU time spent on steps
that are kept) is multiplied by its training speed relative to the plain PyTorch loop's peak
(`strategy_speeds`): `restart` is the plain loop (a job without in-job fault tolerance, the
torch.compile'd HF reference of bench/train_speed.py: 1.0), `spare_ckpt` and `spare_peer` run
this engine with its machinery on (train_speed's `on` phase, tokens/s per GPU over the
reference's). `useful_work` = goodput x speed is the work per GPU-hour relative to that peak,
and the GPU-hours lost count the slower steps too. The speeds come from the data file
(`throughput`, written by bench.fit_planner from a train_speed JSON); without one every strategy
is credited 1.0 and the plan says so.

Failure model: independent Poisson processes per GPU (a rank is lost) and per node (all
`--gpus-per-node` ranks of the node are lost). Defaults from Meta's Llama 3 report
(Dubey et al., "The Llama 3 Herd of Models", 2024, section 3.3.4 and Table 5): 419 unexpected
interruptions in 54 days of pre-training on 16,384 H100 GPUs (2,048 nodes of 8). Of these,
GPU-local causes (faulty GPU 148, HBM3 72, SRAM 19, GPU system processor 17, silent data
corruption 6, thermal/sensor 6) plus software and NCCL-watchdog causes (54 + 7) are counted per
GPU: 329 / (54 d x 24 h x 16,384) = 1.55e-5 per GPU-hour; host-level causes (network
switch/cable 35, host maintenance 32, NIC 7, SSD 3, power supply 3, chassis 2, IO board 2,
dependency 2, CPU 2, system memory 2) = 90 per node: 90 / (54 d x 24 h x 2,048) = 3.39e-5 per
node-hour. For comparison: Kokolis et al., "Revisiting Reliability in Large-Scale Machine
Learning Research Clusters" (Meta, 2024) report a mean time to failure of about 7.9 h for
1,024-GPU jobs (rate ~1.2e-4 per GPU-hour including all job failures), and the OPT-175B logbook
(Zhang et al., 2022) more than 100 restarts in about two months on 992 A100s. Pass
`--gpu-rate`/`--node-rate` for another fleet.

Recovery phase times come from a cost model per phase, t(N) = a + b * load(N) (a fixed latency
a, a cost b per unit of load: `host_load`, `phase_at`), read from the data file `--data`
(default planner_data.json next to this file: `load_data` says what it holds). The file is
written by `python -m bench.fit_planner` from the benchmark results, so the planner reads no
benchmark output itself. The data file also holds the scale runs the model was fitted to and
another host's runs: the plan reports how well the model predicts both (`validate`,
`validate_other_host`). The measured full restart does not include the scheduler relaunch of a
real cluster (queueing, container start, NCCL warm-up at thousands of ranks): `--relaunch-s`
(default 600 s, an assumption, not a measurement) is added to it. Checkpoint costs:
`--ckpt-stall-s` (training stall per save), `--ckpt-load-s` (reload at scale); defaults are
assumptions, printed.

Optimum checkpoint interval for the restart strategy: Young (1974), "A first order approximation
to the optimum checkpoint interval", CACM 17(9): tau = sqrt(2 * delta * M), delta = checkpoint
cost, M = mean time between failures of the job; Daly (2006), "A higher order estimate of the
optimum checkpoint interval for restart dumps", FGCS 22(3): tau = sqrt(2 delta M) *
(1 + sqrt(delta / (2M)) / 3 + delta / (18 M)) - delta for delta < 2M, else tau = M.

Usage: python main.py plan [--gpus 1000 4096 16384 65536 100000] [--days 30] [--seed 0] [--data FILE] ...
Prints a table and writes --out (plan.json: the arguments, the model, per G the costs, the spare
scan and each strategy's goodput (`up %`: time), speed and useful work (`useful %`: goodput x
speed; GPU-hours lost per day from it), and the validations) and --png (plan.png: useful work
against G).
Errors: SystemExit when the data file is missing or malformed.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

DATA = Path(__file__).resolve().with_name("planner_data.json")
STRATEGIES = ("restart", "spare_ckpt", "spare_peer")

# Llama 3 (Dubey et al. 2024, Table 5): see the module docstring for the split.
LLAMA3_GPU_RATE = 329 / (54 * 24 * 16384)   # per GPU-hour
LLAMA3_NODE_RATE = 90 / (54 * 24 * 2048)    # per node-hour


def young_interval(delta_s: float, mtbf_s: float) -> float:
    """Young (1974): optimum checkpoint interval sqrt(2 delta M) (seconds)."""
    return math.sqrt(2 * delta_s * mtbf_s)


def daly_interval(delta_s: float, mtbf_s: float) -> float:
    """Daly (2006) higher-order optimum checkpoint interval (seconds)."""
    if delta_s >= 2 * mtbf_s:
        return mtbf_s
    return math.sqrt(2 * delta_s * mtbf_s) * (1 + math.sqrt(delta_s / (2 * mtbf_s)) / 3
                                              + delta_s / (18 * mtbf_s)) - delta_s


@dataclass
class Costs:
    """Seconds of each recovery at G GPUs (already scaled) and the checkpoint costs."""
    detect_s: float
    inplace_s: float          # abort + replace + rebuild + first step's excess, no restore (spare strategies)
    peer_restore_s: float     # restore from peers / host memory
    ckpt_load_s: float        # every rank reloads the newest checkpoint
    restart_s: float          # relaunch + full restart (placement, build, groups, first step)
    ckpt_stall_s: float       # training stall per checkpoint
    step_s: float             # one training step (the in-flight step is re-run by spare_peer)
    refill_s: float           # a used spare is back in the pool after this
    node_extra_s: float = 0.0  # a node loss takes this much longer to recover in place (measured:
                               # its actors are found dead by a ping timeout, not by an error)


@dataclass
class Failure:
    t: float        # seconds since job start
    gpus: int       # GPUs lost (1, or gpus_per_node for a node)
    u: float        # uniform(0, 1): where in the step it hit


def failure_trace(gpus: int, gpus_per_node: int, gpu_rate_h: float, node_rate_h: float,
                  horizon_s: float, seed: int) -> list[Failure]:
    """Poisson failures of the whole job over `horizon_s` (rates per GPU-hour / node-hour)."""
    nodes = math.ceil(gpus / gpus_per_node)
    rate_gpu, rate_node = gpus * gpu_rate_h / 3600, nodes * node_rate_h / 3600
    total = rate_gpu + rate_node
    rng, t, out = random.Random(seed), 0.0, []
    if total <= 0:
        return out
    while True:
        t += rng.expovariate(total)
        if t >= horizon_s:
            return out
        out.append(Failure(t, gpus_per_node if rng.random() < rate_node / total else 1, rng.random()))


@dataclass
class Result:
    strategy: str
    spares: int
    interval_s: float
    useful_s: float = 0.0
    horizon_s: float = 0.0
    failures: int = 0
    waits_for_spares: int = 0
    fallbacks_to_restart: int = 0
    downtime_s: float = 0.0
    rework_s: float = 0.0
    ckpt_s: float = 0.0
    detail: dict = field(default_factory=dict)

    @property
    def goodput(self) -> float:
        return self.useful_s / self.horizon_s if self.horizon_s else 1.0


def simulate(trace: list[Failure], strategy: str, costs: Costs, horizon_s: float, interval_s: float,
             spares: int) -> Result:
    """Run the job for `horizon_s` wall seconds under `strategy` on the failure `trace`.

    Training alternates `interval_s` of work and a checkpoint stall; a failure stops it for the
    strategy's downtime and rolls useful work back (to the last completed checkpoint, or, for
    spare_peer, by the part of the step in flight). A failure during a downtime restarts that
    recovery (its downtime begins again at the new failure). Spares (in GPUs) are consumed by
    the GPUs lost and come back `refill_s` later.
    """
    res = Result(strategy, spares, interval_s, horizon_s=horizon_s)
    t = 0.0              # wall clock
    work = 0.0           # useful training seconds so far
    saved = 0.0          # work in the last committed checkpoint
    since_ckpt = 0.0     # training seconds since the last checkpoint
    pool, refills = spares, []   # spares in the pool; times at which used spares come back
    busy_until = 0.0     # end of the current downtime

    def train_until(end: float) -> None:
        nonlocal t, work, saved, since_ckpt
        while t < end:
            if interval_s <= 0:  # no checkpoints
                work += end - t
                t = end
                return
            to_ckpt = interval_s - since_ckpt
            if t + to_ckpt > end:
                work += end - t
                since_ckpt += end - t
                t = end
                return
            t += to_ckpt
            work += to_ckpt
            since_ckpt = interval_s
            if t + costs.ckpt_stall_s > end:  # failure during the save: not committed
                res.ckpt_s += end - t
                t = end
                return
            t += costs.ckpt_stall_s
            res.ckpt_s += costs.ckpt_stall_s
            saved, since_ckpt = work, 0.0

    for f in trace:
        if f.t >= horizon_s:
            break
        res.failures += 1
        if f.t >= busy_until:
            train_until(f.t)
        else:  # failure during a recovery: that recovery starts again
            t = f.t
        while refills and refills[0] <= t:
            refills.pop(0)
            pool += 1
        if strategy == "spare_peer":
            lost = min(work - saved, f.u * costs.step_s) if interval_s > 0 else f.u * costs.step_s
            recovery = costs.detect_s + costs.inplace_s + costs.peer_restore_s
            if f.gpus > 1:
                recovery += costs.node_extra_s
        else:
            lost = work - saved
            recovery = costs.detect_s + (costs.inplace_s + costs.ckpt_load_s + (costs.node_extra_s if f.gpus > 1 else 0)
                                         if strategy == "spare_ckpt" else costs.restart_s)
        if strategy != "restart":
            if pool < f.gpus:  # wait for refills, or restart the whole job when that is faster
                need = f.gpus - pool
                wait = refills[need - 1] - t if len(refills) >= need else math.inf
                if wait + recovery < costs.detect_s + costs.restart_s:
                    res.waits_for_spares += 1
                    del refills[:need]
                    pool += need
                    recovery += wait
                else:
                    res.fallbacks_to_restart += 1
                    recovery = costs.detect_s + costs.restart_s
                    lost = work - saved
            if pool >= f.gpus:  # a restart also replaces the lost GPUs from the pool when it can
                pool -= f.gpus
                refills.extend([t + recovery + costs.refill_s] * f.gpus)
                refills.sort()
        work -= lost
        res.rework_s += lost
        since_ckpt = max(0.0, since_ckpt - lost) if strategy == "spare_peer" else 0.0
        if strategy != "spare_peer":
            saved = work
        end = min(horizon_s, t + recovery)
        res.downtime_s += end - t
        t = busy_until = end
    if t < horizon_s:
        train_until(horizon_s)
    res.useful_s = work
    return res


# -- the recovery-cost model ------------------------------------------------------------------
PHASES = ("detect_s", "abort_s", "replace_s", "rebuild_s", "restore_s", "first_step_excess_s")
LOCAL_PHASES = ("first_step_excess_s",)  # each rank's work does not grow with its peers (compute)


def host_load(n: int, cores: int | None, phase: str = "rebuild_s") -> float:
    """The load factor x of `phase` at n ranks: a rank's work, n (it grows with the peers:
    connections, store clients) or 1 (LOCAL_PHASES), times the oversubscription of the host,
    max(1, n / cores), when all n ranks share one host of `cores` cores (the CPU scale runs);
    cores=None: a cluster, a core or more per rank."""
    return (1 if phase in LOCAL_PHASES else n) * (max(1.0, n / cores) if cores else 1.0)


def fit_phase(ns: list[int], ys: list[float], cores: int, phase: str) -> tuple[float, float]:
    """(a, b) of y = a + b * host_load(n, cores, phase), a, b >= 0, by least squares on the
    relative error (weights 1/y^2): a is the fixed latency (s), b the cost per unit of load (s)."""
    xs = [host_load(n, cores, phase) for n in ns]
    ws = [1 / max(y, 1e-6) ** 2 for y in ys]
    sw = sum(ws)
    mx, my = sum(w * x for w, x in zip(ws, xs)) / sw, sum(w * y for w, y in zip(ws, ys)) / sw
    den = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    b = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / den if den else 0.0
    if b <= 0:
        return my, 0.0
    a = my - b * mx
    if a < 0:
        return 0.0, sum(w * x * y for w, x, y in zip(ws, xs, ys)) / sum(w * x * x for w, x in zip(ws, xs))
    return a, b


def load_data(path: Path) -> dict:
    """The planner's inputs from the JSON file `path` (written by `python -m bench.fit_planner`):
    {"model": {"base": {phase: a (s)}, "per_rank": {phase: b (s per unit of load)},
    "full_restart_s", "source": [files it was fitted to], and, where measured, "gpu_base": {phase:
    a on GPUs (s)}, "node_extra_s", "host_cores" (of the host of the fitted runs), "held_out":
    {phase: [a, b]} fitted without the largest N, "scale_rows": {N: measured total (s)}},
    "throughput" (where measured): {"engine_tokens_per_s_per_gpu", "reference_tokens_per_s_per_gpu",
    "source", ...} (`strategy_speeds`)}, "other_host": {"cores", "rows": [scale-run rows of another
    host]} (optional)}.
    Raises SystemExit when the file cannot be read or lacks the model."""
    try:
        data = json.loads(Path(path).read_text())
        model = data["model"]
        model["scale_rows"] = {int(n): s for n, s in model.get("scale_rows", {}).items()}  # JSON keys are strings
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise SystemExit(f"--data {path}: not a planner data file ({e!r}); write one with "
                         "`python -m bench.fit_planner`") from e
    return data


def phase_at(model: dict, phase: str, n: int, gpu: bool = True, host_cores: int | None = None,
             fit: dict | None = None) -> float:
    """Seconds of `phase` at n ranks: the fixed part (the GPU run's when `gpu` and measured) plus
    the cost per unit of load times `host_load(n, host_cores, phase)`; `fit`: {phase: (a, b)}
    instead of the model's."""
    a, b = fit[phase] if fit else (model["base"][phase], model["per_rank"][phase])
    if gpu and "gpu_base" in model:
        a = model["gpu_base"][phase]
    return a + b * host_load(n, host_cores, phase)


def predicted_recovery_s(model: dict, n: int, gpu: bool = False, host_cores: int | None = None,
                         fit: dict | None = None) -> float:
    """Predicted total of an in-place recovery with peer restore at n ranks."""
    return sum(phase_at(model, p, n, gpu, host_cores, fit) for p in PHASES)


def strategy_speeds(model: dict) -> dict[str, float]:
    """Training speed of each strategy relative to the plain loop's peak (tokens/s per GPU):
    `restart` 1.0 (it is the plain loop), `spare_ckpt` / `spare_peer` the engine's measured
    tokens/s per GPU over the reference's (`model["throughput"]`); all 1.0 when not measured."""
    t = model.get("throughput")
    engine = t["engine_tokens_per_s_per_gpu"] / t["reference_tokens_per_s_per_gpu"] if t else 1.0
    return {"restart": 1.0, "spare_ckpt": engine, "spare_peer": engine}


def costs_for(model: dict, gpus: int, args) -> Costs:
    inplace = sum(phase_at(model, p, gpus) for p in ("abort_s", "replace_s", "rebuild_s", "first_step_excess_s"))
    rebuild_growth = phase_at(model, "rebuild_s", gpus, gpu=False) - model["base"]["rebuild_s"]
    return Costs(detect_s=phase_at(model, "detect_s", gpus), inplace_s=inplace,
                 peer_restore_s=phase_at(model, "restore_s", gpus), ckpt_load_s=args.ckpt_load_s,
                 restart_s=args.relaunch_s + model["full_restart_s"] + rebuild_growth + args.ckpt_load_s,
                 ckpt_stall_s=args.ckpt_stall_s, step_s=args.step_s, refill_s=args.refill_h * 3600,
                 node_extra_s=model.get("node_extra_s", 0.0))


def plan_one(gpus: int, args, model: dict) -> dict:
    horizon = args.days * 86400
    nodes = math.ceil(gpus / args.gpus_per_node)
    rate_h = gpus * args.gpu_rate + nodes * args.node_rate
    mtbf_s = 3600 / rate_h if rate_h > 0 else float("inf")
    costs = costs_for(model, gpus, args)
    traces = [failure_trace(gpus, args.gpus_per_node, args.gpu_rate, args.node_rate, horizon, args.seed + k)
              for k in range(args.traces)]
    young = young_interval(costs.ckpt_stall_s, mtbf_s) if rate_h > 0 else args.interval_h * 3600
    daly = daly_interval(costs.ckpt_stall_s, mtbf_s) if rate_h > 0 else args.interval_h * 3600
    interval = args.interval_h * 3600 if args.interval_h else daly

    def run(strategy, spares, tau):
        rs = [simulate(tr, strategy, costs, horizon, tau, spares) for tr in traces]
        return {"goodput": statistics.mean(r.goodput for r in rs),
                "failures": statistics.mean(r.failures for r in rs),
                "waits_for_spares": statistics.mean(r.waits_for_spares for r in rs),
                "fallbacks_to_restart": statistics.mean(r.fallbacks_to_restart for r in rs)}

    # Spares: candidates in whole nodes; pick the count with the fewest GPU-hours lost, spares'
    # idle hours included (spare GPUs are paid for too).
    cands = {args.gpus_per_node * k for k in (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)}
    if args.spares is not None:
        cands.add(args.spares)
    by_spares = {}
    for s in sorted(cands):
        r = run("spare_peer", s, interval)
        lost_h = (1 - r["goodput"]) * gpus * args.days * 24 + s * args.days * 24
        by_spares[s] = {**r, "lost_gpu_h_incl_spares": lost_h}
    best_spares = min(by_spares, key=lambda s: (round(by_spares[s]["lost_gpu_h_incl_spares"], 6), s))
    spares = args.spares if args.spares is not None else best_spares
    # Checkpoint interval of ours: a failure rolls nothing back to the checkpoint (peer restore),
    # unless the pool runs dry and the job restarts, so the best interval is longer than Daly's;
    # the planner scans a grid (Daly's interval included).
    grid = sorted({interval, young, *(h * 3600 for h in (0.25, 0.5, 1, 2, 4, 8, 24))})
    peer_by_tau = {tau: run("spare_peer", spares, tau)["goodput"] for tau in grid}
    ours_tau = interval if args.interval_h else max(peer_by_tau, key=peer_by_tau.get)
    out = {"gpus": gpus, "nodes": nodes, "mtbf_h": mtbf_s / 3600, "failures_per_day": rate_h * 24,
           "young_interval_h": young / 3600, "daly_interval_h": daly / 3600, "interval_h": interval / 3600,
           "spares": spares, "recommended_spares": best_spares,
           "recommended_interval_h_restart": daly / 3600,
           "recommended_interval_h_ours": max(peer_by_tau, key=peer_by_tau.get) / 3600,
           "costs": asdict(costs), "spare_scan": by_spares, "strategies": {}}
    speeds = strategy_speeds(model)
    for strategy in STRATEGIES:
        tau = ours_tau if strategy == "spare_peer" else interval
        r = run(strategy, spares, tau)
        useful = r["goodput"] * speeds[strategy]
        out["strategies"][strategy] = {**r, "speed": speeds[strategy], "useful_work": useful,
                                       "interval_h": tau / 3600, "lost_gpu_h_per_day": (1 - useful) * gpus * 24,
                                       "lost_h_per_day": (1 - r["goodput"]) * 24}
    return out


def validate(model: dict) -> list[dict]:
    """The planner's predicted recovery time for each measured N against the measurement (N
    ranks on one host of `host_cores` cores): `fit` from all scale runs, and `held_out` from
    the runs without the largest N (a true prediction for that N)."""
    rows = []
    for n, measured in sorted(model.get("scale_rows", {}).items()):
        row = {"n": n, "measured_s": measured}
        for name, fit in (("fit", None), ("held_out", model.get("held_out"))):
            if name == "fit" or fit:
                pred = predicted_recovery_s(model, n, host_cores=model["host_cores"], fit=fit)
                row |= {f"{name}_predicted_s": pred, f"{name}_error": pred / measured - 1}
        rows.append(row)
    return rows


def validate_other_host(model: dict, rows: list[dict], cores: int) -> list[dict]:
    """Does the cost per unit of load carry over to another host? That host's actor-kill runs
    (`rows`, N ranks on one host of `cores` cores) are predicted from this model's costs b with
    that host's own fixed latencies, from its smallest N: a = y(N_min) - b x host_load(N_min).
    Compared: the control part (the total without the first step's excess, whose cost per rank
    is the host's compute speed), of the fastest run of each N (a run on a shared host is only ever
    slowed down by it, so the fastest is the closest to the cost of the code)."""
    actor = [r for r in rows if r["failure"] == "actor"]
    ns = sorted({r["n"] for r in actor})
    ctrl = [p for p in PHASES if p not in LOCAL_PHASES]
    best = {n: min((r for r in actor if r["n"] == n), key=lambda r: sum(r[p] for p in ctrl)) for n in ns}
    b = model["per_rank"]
    fixed = {p: best[ns[0]][p] - b[p] * host_load(ns[0], cores, p) for p in ctrl}
    out = []
    for n in ns:
        measured = sum(best[n][p] for p in ctrl)
        predicted = sum(fixed[p] + b[p] * host_load(n, cores, p) for p in ctrl)
        out.append({"n": n, "cores": cores, "measured_s": measured, "predicted_s": predicted,
                    "error": predicted / measured - 1})
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4))
    gs = [r["gpus"] for r in results]
    for s, label in zip(STRATEGIES, ("full restart from checkpoint", "hot spares + checkpoint reload",
                                      "hot spares + peer restore (ours)")):
        ax.plot(gs, [100 * r["strategies"][s]["useful_work"] for r in results], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("useful work (% of the plain loop's peak)")
    ax.set_title("Simulated goodput x speed (Llama 3 failure rates)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, nargs="+", default=[1000, 4096, 16384, 65536, 100000])
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--days", type=float, default=30.0, help="simulated wall time of the job")
    p.add_argument("--gpu-rate", type=float, default=LLAMA3_GPU_RATE, help="failures per GPU-hour")
    p.add_argument("--node-rate", type=float, default=LLAMA3_NODE_RATE, help="failures per node-hour")
    p.add_argument("--interval-h", type=float, default=0.0,
                   help="checkpoint interval in hours (0: Daly's optimum for each G)")
    p.add_argument("--ckpt-stall-s", type=float, default=60.0, help="training stall per checkpoint (assumed)")
    p.add_argument("--ckpt-load-s", type=float, default=300.0, help="checkpoint reload at scale (assumed)")
    p.add_argument("--relaunch-s", type=float, default=600.0,
                   help="scheduler relaunch of the whole job, on top of the measured restart (assumed)")
    p.add_argument("--step-s", type=float, default=10.0, help="seconds per training step")
    p.add_argument("--refill-h", type=float, default=2.0, help="hours until a used spare is replaced")
    p.add_argument("--spares", type=int, default=None, help="spare GPUs (default: the recommended count)")
    p.add_argument("--traces", type=int, default=3, help="failure traces averaged per point")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=str(DATA), help="the planner's data file (load_data; default %(default)s)")
    p.add_argument("--out", default="plan.json", help="the plan as JSON (default %(default)s)")
    p.add_argument("--png", default="plan.png", help="goodput against G (default %(default)s; '' for none)")
    args = p.parse_args(argv)
    data = load_data(Path(args.data))
    model = data["model"]
    results = [plan_one(g, args, model) for g in args.gpus]
    checks = validate(model)
    other_host = data.get("other_host")
    other = validate_other_host(model, other_host["rows"], other_host["cores"]) if other_host else []

    print(f"phase model from {', '.join(model['source']) or 'defaults'}: seconds = fixed + b x load "
          f"(load on a cluster: N ranks, 1 for the first step's excess): "
          + ", ".join(f"{k[:-2]} {model.get('gpu_base', model['base'])[k]:.3f} + {model['per_rank'][k]:.2g}"
                      for k in PHASES))
    print(f"failure rates: {args.gpu_rate:.3g}/GPU-h, {args.node_rate:.3g}/node-h; {args.days:g} days; "
          f"assumed: ckpt stall {args.ckpt_stall_s:g}s, ckpt load {args.ckpt_load_s:g}s, "
          f"relaunch {args.relaunch_s:g}s, refill {args.refill_h:g}h, step {args.step_s:g}s")
    speeds = strategy_speeds(model)
    t = model.get("throughput")
    print("speed relative to the plain loop's peak (tokens/s per GPU): "
          + ", ".join(f"{s} {v:.3f}" for s, v in speeds.items())
          + (f" (measured: {t['source']})" if t else " (not measured: every strategy credited 1.0; "
             "run bench/train_speed.py on a GPU, then python -m bench.fit_planner)"))
    head = ("GPUs", "fail/day", "MTBF h", "ckpt h", "ours ckpt h", "spares", "ours restarts",
            *[f"{s} up %" for s in STRATEGIES], *[f"{s} useful %" for s in STRATEGIES],
            *[f"{s} GPUh/day" for s in STRATEGIES])
    lines = [head]
    for r in results:
        st = r["strategies"]
        lines.append((str(r["gpus"]), f"{r['failures_per_day']:.1f}", f"{r['mtbf_h']:.2f}", f"{r['interval_h']:.2f}",
                      f"{st['spare_peer']['interval_h']:.2f}", str(r["spares"]),
                      f"{st['spare_peer']['fallbacks_to_restart']:.1f}", *[f"{100 * st[s]['goodput']:.2f}" for s in STRATEGIES],
                      *[f"{100 * st[s]['useful_work']:.2f}" for s in STRATEGIES],
                      *[f"{st[s]['lost_gpu_h_per_day']:.0f}" for s in STRATEGIES]))
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(x.rjust(w) for x, w in zip(line, widths)))
    print("\nrecommended: spare GPUs (fewest GPU-hours lost, spares' idle time included) and checkpoint "
          "interval (Daly optimum for restart; best on a grid for ours)")
    for r in results:
        print(f"  G={r['gpus']}: {r['recommended_spares']} spares; checkpoint every "
              f"{r['recommended_interval_h_restart']:.2f} h (restart; Young {r['young_interval_h']:.2f} h), "
              f"{r['recommended_interval_h_ours']:.2f} h (ours)")
    if checks:
        print(f"\nvalidation against the measured scale runs (in-place recovery, N ranks on one "
              f"{model['host_cores']}-core host; held out: fitted without the largest N):")
        for c in checks:
            print(f"  N={c['n']}: measured {c['measured_s']:.3f}s, predicted {c['fit_predicted_s']:.3f}s "
                  f"({100 * c['fit_error']:+.0f}%)" + (f", held out {c['held_out_predicted_s']:.3f}s "
                  f"({100 * c['held_out_error']:+.0f}%)" if "held_out_error" in c else ""))
    if other:
        print(f"\nthe same costs per unit of load on a {other[0]['cores']}-core host (its fixed latencies from "
              f"N={other[0]['n']}; control part = detect .. restore; fastest run of each N):")
        for c in other:
            print(f"  N={c['n']}: measured {c['measured_s']:.3f}s, predicted {c['predicted_s']:.3f}s "
                  f"({100 * c['error']:+.0f}%)")
    out = {"args": vars(args), "model": model, "results": results, "validation": checks,
           "validation_other_host": other}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    if args.png:
        plot(results, Path(args.png))
    print(f"wrote {args.out}" + (f" and {args.png}" if args.png else ""))
    return out
