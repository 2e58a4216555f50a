#!/usr/bin/env bash
# bench/control_plane.py on this host's CPU cores (control plane only: the rank actors' engine
# does no math; no GPU used). Logical nodes of 8 ranks, each with its node agent.
#   MODE nostore (default): N = 64 256 1024, no join barrier (no torch in the rank actors,
#     ~60 MB PSS each: 1,024 fit 128 GiB).
#   MODE store: N = 64 256 512, the join barrier through the driver's TCPStore (torch in every
#     rank actor, ~190 MB PSS each: 1,024 do not fit 128 GiB; the bench skips a size whose
#     projected PSS exceeds 90% of MemAvailable).
# Per size: 10 timed steps through the flat tree of node agents (the driver calls every agent)
# and 10 through the tree of fanout 4 (agent_tree.FANOUT; --fanout K to change it), on the same
# actors, a 3 s idle window each, then detection (killed, SIGSTOPped) and recovery control
# through the tree; a run stays under BENCH_TIMEOUT (default 580 s); every phase (the start of
# 1,155 actors too) has a 420 s limit, recorded as the size's failure in the JSON, which is
# rewritten after every size. A size whose projected PSS or threads do not fit is skipped and
# recorded: every actor runs with bench.control_plane.ACTOR_ENV (Ray's gRPC pools of one thread:
# ~24 threads per actor on 16 cores instead of ~48, each a pid: 1,155 actors need ~28k of
# kernel.pid_max 32,768).
# Keeps control_plane[_store]_KIND_DATE (KIND: bench_lib.sh device_kind).cmd/.log/.json in bench/results/gpu/ and copies
# them to $OUT when it is set (the device tool brings back what is there).
# Usage (repo root, after `source .gpu/install.sh .gpu`):
#   BENCH_TIMEOUT=580 bash bench/results/gpu/run_control_plane.sh [nostore|store] [more bench args]
set -o pipefail
source "$(dirname "$0")/bench_lib.sh"
mode=${1:-nostore}
shift || true
dest=bench/results/gpu
case $mode in
  nostore) name=control_plane_$(device_kind)_$(date +%F); sizes="${SIZES:-64 256 1024} --no-store" ;;
  store) name=control_plane_store_$(device_kind)_$(date +%F); sizes="${SIZES:-64 256 512}" ;;
  *) echo "mode must be nostore or store, got '$mode'"; exit 2 ;;
esac
ulimit -n "$(ulimit -Hn)" 2>/dev/null  # the driver holds a connection to each of ~1,155 actors
echo "pid_max $(cat /proc/sys/kernel/pid_max), threads-max $(cat /proc/sys/kernel/threads-max), cgroup pids.max $(cat /sys/fs/cgroup/pids.max 2>/dev/null || echo n/a)"
echo "$(nproc) cores, $(free -g | awk '/Mem:/ {print $7}') GB available, open files $(ulimit -n) soft / $(ulimit -Hn) hard"
keep_run "$name" "$dest" "${BENCH_TIMEOUT:-580}" 40 "python3 -m bench.control_plane --sizes $sizes
 --steps 10 --idle-s 3 --phase-timeout-s 420 --out $dest/$name.json $*"
[ -n "${OUT:-}" ] && cp "$dest/$name"* "$OUT"/
