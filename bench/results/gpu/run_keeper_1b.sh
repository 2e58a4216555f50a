#!/usr/bin/env bash
# bench/keeper.py with the Megatron engine on the ~1.4B GPT of run_train_speed_1b.sh (24 layers,
# hidden 2048, 16 heads, ffn 5632, vocab 32000, seq 2048; 1.364B params), one GPU (dp=1, the
# distributed optimizer), 16 sequences x 2048 tokens per step (one GPU's share of that script's
# global batch 32 at dp=2; one optimizer step, micro-batches of 2). The shard keeper at the shard
# size of dp=8 (1/8 of the optimizer state, kept every step: the holder of this host adopts the
# arenas as a one-node job's keeper does; with --courier sent through Ray by the courier process,
# as to a keeper on another node) against no keeper, interleaved in one process: 3 warm-up
# steps, then 8 rounds of one block per case (1 untimed + 6 timed steps each): 48 timed steps per
# case, about 115 steps in all (~3-4 min with the start). Prints the table; keeps NAME.cmd/.log/.json in DEST (the JSON rewritten after each
# round: a run cut short by BENCH_TIMEOUT leaves "complete": false). More bench args (e.g.
# --breakdown, --fractions 0.125,1, --courier) are passed on; BENCH_TIMEOUT (s) bounds the run.
# Usage (repo root, GPU machine, after `source .gpu/install.sh .gpu`):
#   bash bench/results/gpu/run_keeper_1b.sh NAME DEST [more bench args]
set -o pipefail
source "$(dirname "$0")/bench_lib.sh"
name=$1 dest=$2
shift 2
keep_run "$name" "$dest" "${BENCH_TIMEOUT:-345}" 30 "python3 -m bench.keeper --fractions 0.125 --warmup 3
 --blocks 8 --block-steps 6 --settle 1 --out $dest/$name.json $MODEL_1B
 --set train.global_batch_size=16 --set train.mini_batch_size=16 --set train.micro_batch_size=2 $*"
