#!/usr/bin/env bash
# bench/keeper.py with the Megatron engine on the ~1.4B GPT of run_train_speed_1b.sh (24 layers,
# hidden 2048, 16 heads, ffn 5632, vocab 32000, seq 2048; 1.364B params), one GPU (dp=1, the
# distributed optimizer), 16 sequences x 2048 tokens per step (one GPU's share of that script's
# global batch 32 at dp=2; one optimizer step, micro-batches of 2). Phases: off (no keeper), then
# the shard keeper at the shard size of dp=8 (1/8 of the optimizer state) and of dp=1 (all of
# it; skipped, and noted, when the host lacks the memory), 2 warm-up + 8 timed steps each.
# Keeps NAME.cmd/.log/.json in DEST.
# Usage (repo root, GPU machine, after `source .gpu/install.sh .gpu`):
#   bash bench/results/gpu/run_keeper_1b.sh NAME DEST [more bench args]
set -o pipefail
source "$(dirname "$0")/bench_lib.sh"
name=$1 dest=$2
shift 2
keep_run "$name" "$dest" "${BENCH_TIMEOUT:-540}" 30 "python3 -m bench.keeper --fractions 0.125,1 --warmup 2 --steps 8
 --out $dest/$name.json $MODEL_1B
 --set train.global_batch_size=16 --set train.mini_batch_size=16 --set train.micro_batch_size=2 $*"
