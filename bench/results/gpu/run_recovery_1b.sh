#!/usr/bin/env bash
# bench/recovery.py with the Megatron engine on a ~1.4B GPT (24 layers, hidden 2048, seq 2048),
# tp=1 dp=2, 2 workers + 2 spares sharing 2 GPUs (gpus_per_actor 0.5), peer restore (no
# distributed optimizer: each DP replica holds the full state). Keeps NAME.cmd/.log/.json in DEST.
# Usage (repo root, GPU machine, after `source .gpu/install.sh .gpu`): bash bench/results/gpu/run_recovery_1b.sh NAME DEST [args]
set -o pipefail
source "$(dirname "$0")/bench_lib.sh"
name=$1 dest=$2
shift 2
keep_run "$name" "$dest" "${BENCH_TIMEOUT:-400}" 25 "python3 -m bench.recovery --repeats 2 --out $dest/$name.json
 --set cluster.num_workers=2 --set cluster.num_spares=2 --set cluster.gpus_per_actor=0.5
 --set cluster.cpus_per_actor=1 --set fault_tolerance.min_step_timeout_s=60
 --set fault_tolerance.health_timeout_s=10 --set model.distributed_optimizer=false $MODEL_1B
 --set train.global_batch_size=8 --set train.mini_batch_size=4 --set train.micro_batch_size=1
 --set train.steps=8 $*"
