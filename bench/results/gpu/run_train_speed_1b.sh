#!/usr/bin/env bash
# bench/train_speed.py with the Megatron engine on the ~1.4B GPT of run_recovery_1b.sh (24 layers,
# hidden 2048, 16 heads, ffn 5632, vocab 32000, seq 2048; 1.364B params), tp=1 dp=2: 2 workers,
# one per GPU, no spares (an idle spare costs no step time), the distributed optimizer (main.py's
# default: engine.snapshot() then copies nothing), global batch 32 x 2048 = 65,536 tokens per
# step (one optimizer step, micro-batches of 2). Phases off / on_no_memory / on (on: memory
# snapshots sent to a holder actor every step), 1 warm-up + 6 timed steps each; a phase stops
# early at 75% host memory (the holder sends can pile up: ~11 GB per rank per step).
# Keeps NAME.cmd/.log/.json in DEST.
# Usage (repo root, GPU machine, after `source .gpu/install.sh .gpu`):
#   bash bench/results/gpu/run_train_speed_1b.sh NAME DEST [more bench args]
# e.g. the full-state variant (per-step rollback snapshot of ~19 GB/rank to pinned memory, peer restore):
#   bash bench/results/gpu/run_train_speed_1b.sh NAME DEST --set model.distributed_optimizer=false
set -o pipefail
source "$(dirname "$0")/bench_lib.sh"
name=$1 dest=$2
shift 2
keep_run "$name" "$dest" "${BENCH_TIMEOUT:-540}" 45 "python3 -m bench.train_speed --warmup 1 --steps 6 --max-host-mem 0.75
 --lag-timeout 90 --out $dest/$name.json
 --set cluster.num_workers=2 --set cluster.num_spares=0 --set cluster.gpus_per_actor=1
 --set cluster.cpus_per_actor=1 --set fault_tolerance.min_step_timeout_s=60
 --set fault_tolerance.health_timeout_s=10 $MODEL_1B
 --set train.global_batch_size=32 --set train.mini_batch_size=32 --set train.micro_batch_size=2 $*"
