#!/usr/bin/env bash
# Issue 35 item 8: bench/recovery.py with the defaults only (`defaults_only` in the JSON) on the
# ~1.4B GPT of bench_lib.sh's MODEL_1B (its shape, not its learning rate), 1 worker + 1 spare
# sharing one GPU (gpus_per_actor auto: 0.5), the rank killed in the middle of a step 3 times
# (the spare's bundle refilled between kills). Defaults that matter here: async checkpoint saves
# every 2 steps, the local keeper (fault_tolerance.shard_keeper at dp = 1), the distributed
# optimizer. No run without failure (--no-reference: half the time, and its checkpoints would
# share the disk) and no full restarts. Keeps NAME.cmd/.log/.json in DEST; more bench args are
# passed on (e.g. --set fault_tolerance.shard_keeper=false --set checkpoint.async_save=false for
# the settings before item 8); BENCH_TIMEOUT (s) bounds the run.
# Usage (repo root, GPU machine, after `source .gpu/install.sh .gpu`):
#   bash bench/results/gpu/run_recovery_1b_defaults.sh NAME DEST [more bench args]
set -o pipefail
source "$(dirname "$0")/bench_lib.sh"
name=$1 dest=$2
shift 2
keep_run "$name" "$dest" "${BENCH_TIMEOUT:-580}" 30 "python3 -m bench.recovery --repeats 3 --full-restarts 0
 --no-reference --out $dest/$name.json --set cluster.num_workers=1 --set cluster.num_spares=1
 --set model.num_layers=24 --set model.hidden_size=2048 --set model.num_heads=16
 --set model.ffn_hidden_size=5632 --set model.vocab_size=32000 --set model.max_seq_len=2048
 --set train.seq_len=2048 --set train.steps=12 $*"
