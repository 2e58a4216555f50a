#!/usr/bin/env bash
# bench/checkpoint_io.py with the Megatron engine on the ~1.4B GPT of run_recovery_1b.sh (24 layers,
# hidden 2048, 16 heads, ffn 5632, vocab 32000, seq 2048; 1.364B params), one GPU, world size 1
# (a single-rank NCCL group in the bench process), main.py's default distributed optimizer (the
# save/load path of tests/engines/test_megatron_engine.py; with dp=1 it holds the whole state). Train steps
# of bench/train_speed.py's shape (16 x 2048 tokens, micro-batch 8): one so the Adam moments
# exist, then per repeat: raw write/read of the state (~19 GB: bf16 params + fp32 main params +
# exp_avg + exp_avg_sq) with plain fsync'd file writes, the async save with the next step
# trained beside it, verify + load of it, the sync save; local disk under /tmp. The JSON is rewritten after each repeat ("complete": false until the last).
# Keeps NAME.cmd/.log/.json in DEST.
# Usage (repo root, GPU machine, after `source .gpu/install.sh .gpu`):
#   bash bench/results/gpu/run_checkpoint_1b.sh NAME DEST [more bench args]
# e.g. without the distributed optimizer: ... NAME DEST --set model.distributed_optimizer=false
set -o pipefail
source "$(dirname "$0")/bench_lib.sh"
name=$1 dest=$2
shift 2
keep_run "$name" "$dest" "${BENCH_TIMEOUT:-500}" 25 "python3 -m bench.checkpoint_io --engine megatron --repeat 2 --dir /tmp
 --out $dest/$name.json $MODEL_1B --set train.global_batch_size=16 --set train.mini_batch_size=16
 --set train.micro_batch_size=8 $*"
