#!/usr/bin/env bash
# bench/control_plane.py on this host's CPU cores (control plane only: the rank actors' engine
# does no math; no GPU used). Logical nodes of 8 ranks, each with its node agent.
#   MODE nostore (default): N = 64 256 1024, no join barrier (no torch in the rank actors,
#     ~60 MB PSS each: 1,024 fit 128 GiB).
#   MODE store: N = 64 256 512, the join barrier through the driver's TCPStore (torch in every
#     rank actor, ~190 MB PSS each: 1,024 do not fit 128 GiB; the bench skips a size whose
#     projected PSS exceeds 90% of MemAvailable).
# 10 timed steps and a 3 s idle window per size keep a run under ~540 s; every phase has a 200 s
# limit (recorded as the size's failure in the JSON, which is rewritten after every size).
# Keeps control_plane[_store]_nvidia-h200_DATE.cmd/.log/.json in bench/results/gpu/.
# Usage (repo root, after `source .gpu/install.sh .gpu`):
#   bash bench/results/gpu/run_control_plane.sh [nostore|store] [more bench args]
set -o pipefail
source "$(dirname "$0")/bench_lib.sh"
mode=${1:-nostore}
shift || true
dest=bench/results/gpu
case $mode in
  nostore) name=control_plane_nvidia-h200_$(date +%F); sizes="${SIZES:-64 256 1024} --no-store" ;;
  store) name=control_plane_store_nvidia-h200_$(date +%F); sizes="${SIZES:-64 256 512}" ;;
  *) echo "mode must be nostore or store, got '$mode'"; exit 2 ;;
esac
# Each Ray worker runs ~28 threads (2-core VM), each taking a pid: 1,155 workers need ~32k.
echo "pid_max $(cat /proc/sys/kernel/pid_max), threads-max $(cat /proc/sys/kernel/threads-max), cgroup pids.max $(cat /sys/fs/cgroup/pids.max 2>/dev/null || echo n/a)"
echo "$(nproc) cores, $(free -g | awk '/Mem:/ {print $7}') GB available, open files $(ulimit -n) soft / $(ulimit -Hn) hard"
keep_run "$name" "$dest" "${BENCH_TIMEOUT:-540}" 40 "python3 -m bench.control_plane --sizes $sizes
 --steps 10 --idle-s 3 --phase-timeout-s 200 --out $dest/$name.json $*"
