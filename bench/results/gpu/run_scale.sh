#!/usr/bin/env bash
# bench/scale.py (the real CPU engine: smallest model, gloo, pure DP) on this host's CPU cores,
# as high as memory allows: N = 128 192 256 on 4 logical nodes, a killed actor per N; a size whose
# projected actor PSS exceeds --max-mem-gb 110 is skipped (each actor imports torch: ~500 MB PSS
# on this image, measured at N <= 64), and the JSON is rewritten after every size, so a run cut
# by the ~520 s limit keeps the sizes it finished.
# Keeps scale_cpu_host_KIND_DATE.cmd/.log/.json (+ _fit.json; KIND: bench_lib.sh device_kind) in bench/results/gpu/.
# Usage (repo root, after `source .gpu/install.sh .gpu`):
#   bash bench/results/gpu/run_scale.sh [more bench args]
set -o pipefail
source "$(dirname "$0")/bench_lib.sh"
dest=bench/results/gpu
name=scale_cpu_host_$(device_kind)_$(date +%F)
ulimit -n "$(ulimit -Hn)" 2>/dev/null
echo "$(nproc) cores, $(free -g | awk '/Mem:/ {print $7}') GB available, open files $(ulimit -n) soft / $(ulimit -Hn) hard"
keep_run "$name" "$dest" "${BENCH_TIMEOUT:-520}" 40 "python3 -m bench.scale --sizes ${SIZES:-128 192 256}
 --nodes 4 --failures actor --max-mem-gb 110 --out $dest/$name.json $*"
[ -n "${OUT:-}" ] && cp "$dest/$name"* "$OUT"/
