"""The capacity planner's data file from the benchmark results: the recovery-cost model fitted to
the measured phases, and another host's scale runs to check it on.

Per phase a fixed latency a and a cost b per unit of load, t(N) = a + b * host_load(N)
(planner.py), fitted (`planner.fit_phase`) to the medians per N of the actor-kill recoveries of
RESULTS/scale_cpu.json. Those runs put all N actors on one host of few cores (`cores` of
scale_cpu_fit.json), so each rank's work (connecting to its N - 1 peers, the store's N clients)
is also shared among the cores: host_load = N * max(1, N / cores) there, N on a cluster
(max(1, N / cores) and 1 for the first step's excess, compute). Also fitted: the same without the
largest N (`held_out`, a true prediction for that N), and a node loss's extra time over an actor
loss (`node_extra_s`, medians). Without scale runs: the in-place recovery of
RESULTS/recovery_cpu.json, flat (b = 0); its full restart is the restart's measured part. The GPU
recovery run RESULTS/gpu/<--gpu-run> (bench/recovery.py on 2 x H200), when present, gives the
fixed parts on GPUs (`gpu_base`). The strategies' training speeds (`throughput`,
`planner.strategy_speeds`): a bench/train_speed.py run on GPUs with its plain-PyTorch reference,
RESULTS/gpu/<--train-speed> (default: the newest such run, by its date, then name): the
engine's tokens/s per GPU with the machinery on (its `on` phase) and the compiled reference's
(one GPU); absent: no speeds (the planner credits every strategy 1.0). `--other-host`: scale runs of another host (their _fit.json
holds the host's cores), stored for the planner's `validate_other_host`.

Usage (repository root): python -m bench.fit_planner [--results bench/results] [--gpu-run NAME]
                                                      [--train-speed NAME] [--other-host RUN.json ...]
                                                      [--out planner_data.json]
Writes --out in the format of `planner.load_data` and prints what it was fitted to.
Errors: SystemExit when the --other-host runs lack a _fit.json or disagree on 'cores'.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from ftrain.ops.planner import DATA, PHASES, fit_phase

RESULTS = Path(__file__).resolve().parent / "results"
GPU_RUN = "recovery_1b_exactpin_nvidia-h200-x2_2026-11-30c.json"  # newest GPU recovery benchmark (1.36B)
OTHER_HOST_RUNS = "gpu/scale_cpu_h200host_nvidia-h200_2026-12-01.json"  # bench/scale.py on the 16-core device host


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def phase_of(row: dict, phase: str) -> float:
    """`row[phase]`, a recovery's seconds; a row written before `first_step_excess_s` existed
    (2026-12-01) gets it as its first step less its steady step `step_s`, or the whole first step
    when the row has no steady step."""
    if phase == "first_step_excess_s" and phase not in row:
        return max(0.0, row["first_step_s"] - row.get("step_s", 0.0))
    return row[phase]


def measured_model(results: Path = RESULTS, gpu_run: str = GPU_RUN) -> dict:
    """The planner's "model" (see `planner.load_data`) from the benchmark JSON under `results`
    (missing files: that part is left out, see the module docstring)."""
    rec = _load(results / "recovery_cpu.json") or {}
    tl = rec.get("timeline", {})
    model = {"base": {p: phase_of(tl, p) if tl else 0.0 for p in PHASES}, "per_rank": {p: 0.0 for p in PHASES},
             "full_restart_s": rec.get("full_restart_s", 30.0), "source": ["recovery_cpu.json"] if rec else []}
    rows = _load(results / "scale_cpu.json")
    actor = [r for r in rows or [] if r["failure"] == "actor"]
    ns = sorted({r["n"] for r in actor})
    if len(ns) >= 2:
        cores = (_load(results / "scale_cpu_fit.json") or {}).get("cores", 2)
        med = {p: [statistics.median(phase_of(r, p) for r in actor if r["n"] == n) for n in ns] for p in PHASES}
        fits = {p: fit_phase(ns, med[p], cores, p) for p in PHASES}
        held_out = {p: fit_phase(ns[:-1], med[p][:-1], cores, p) for p in PHASES} if len(ns) >= 3 else None
        model.update(base={p: a for p, (a, _) in fits.items()}, per_rank={p: b for p, (_, b) in fits.items()},
                     host_cores=cores, held_out=held_out,
                     scale_rows={n: statistics.median(r["total_s"] for r in actor if r["n"] == n) for n in ns})
        node = [r["total_s"] for r in rows if r["failure"] == "node"]
        if node:
            model["node_extra_s"] = max(0.0, statistics.median(node) - statistics.median(
                r["total_s"] for r in actor))
        model["source"].append("scale_cpu.json")
    gpu = _load(results / "gpu" / gpu_run)
    if gpu and gpu.get("timeline"):
        model["gpu_base"] = {p: phase_of(gpu["timeline"], p) for p in PHASES}
        model["source"].append(f"gpu/{gpu_run}")
    return model


def _has_reference(run: dict | None) -> bool:
    return bool(run) and "tokens_per_s" in (run.get("reference") or {}).get("compiled", {}) \
        and bool(run["on"]["tokens_per_s"]) and run["layout"]["gpus"] > 0


def newest_train_speed(results: Path = RESULTS) -> str | None:
    """Name (under results/gpu) of the newest train_speed JSON with a compiled reference, by its
    config date, then its name; None if there is none."""
    runs = [(r["config"]["date"], f.name) for f in (results / "gpu").glob("train_speed_*.json")
            if _has_reference(r := _load(f))]
    return max(runs)[1] if runs else None


def measured_throughput(results: Path, name: str | None) -> dict | None:
    """The planner's "throughput" from the train_speed JSON results/gpu/`name` (None without
    one, or when it has no compiled reference): tokens/s per GPU of the engine with the
    machinery on and off, and of the plain loop's reference (compiled, eager)."""
    run = _load(results / "gpu" / name) if name else None
    if not _has_reference(run):
        return None
    gpus, ref = run["layout"]["gpus"], run["reference"]
    return {"engine_tokens_per_s_per_gpu": run["on"]["tokens_per_s"] / gpus,
            "engine_off_tokens_per_s_per_gpu": run["off"]["tokens_per_s"] / gpus,
            "reference_tokens_per_s_per_gpu": ref["compiled"]["tokens_per_s"],
            "reference_eager_tokens_per_s_per_gpu": ref.get("eager", {}).get("tokens_per_s"),
            "device": run["device"], "params": run["params"], "source": f"gpu/{name}"}


def other_host(files: list[str]) -> dict:
    """{"cores", "source", "rows"} of the scale runs `files` of one other host: the actor-kill
    rows, with their phases only (what `planner.validate_other_host` reads)."""
    cores = {(_load(Path(f).with_name(Path(f).stem + "_fit.json")) or {}).get("cores") for f in files}
    if len(cores) != 1 or None in cores:
        raise SystemExit(f"--other-host: every file needs its _fit.json with the same 'cores', got {cores}")
    rows = [{"n": r["n"], "failure": r["failure"], **{p: r[p] for p in PHASES}}
            for f in files for r in _load(Path(f)) or [] if r["failure"] == "actor"]
    return {"cores": cores.pop(), "source": [Path(f).name for f in files], "rows": rows}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=str(RESULTS), help="where the benchmark JSON is read")
    p.add_argument("--gpu-run", default=GPU_RUN, help="GPU recovery JSON under RESULTS/gpu for the fixed phase costs")
    p.add_argument("--train-speed", default=None,
                   help="train_speed JSON under RESULTS/gpu with a reference (default: the newest such)")
    p.add_argument("--other-host", nargs="*", default=[str(f) for f in sorted(RESULTS.glob(OTHER_HOST_RUNS))],
                   help="scale runs (bench/scale.py JSON, cores in its _fit.json) of another host")
    p.add_argument("--out", default=str(DATA))
    args = p.parse_args(argv)
    model = measured_model(Path(args.results), args.gpu_run)
    throughput = measured_throughput(Path(args.results), args.train_speed or newest_train_speed(Path(args.results)))
    if throughput:
        model["throughput"] = throughput
        model["source"].append(throughput["source"])
    data = {"model": model}
    if args.other_host and "host_cores" in model:
        data["other_host"] = other_host(args.other_host)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    print(f"model fitted to {', '.join(model['source']) or 'nothing (defaults)'}"
          + (f"; other host: {', '.join(data['other_host']['source'])}" if "other_host" in data else "")
          + f"\nwrote {args.out}")
    return data


if __name__ == "__main__":
    main()
