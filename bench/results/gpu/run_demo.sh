#!/usr/bin/env bash
# Run one GPU demo layout of `main.py demo` (reference run, then the same steps with ranks
# killed and replaced by spares) and keep its evidence: NAME.cmd, NAME.log, NAME.json in DEST.
# Usage (repo root, GPU machine): bash bench/results/gpu/run_demo.sh NAME small|medium|1b DEST [main.py args]
# Workers and spares share the GPUs (gpus_per_actor 0.5: 2 workers + 2 spares on 2 GPUs).
# health_timeout_s 10: a survivor's abort of Megatron's NCCL communicators took ~1 s (2026-11-29) since
# they are aborted in parallel (megatron_actor.abort_process_groups); sequentially it took > 30 s.
set -o pipefail
source "$(dirname "$0")/bench_lib.sh"
name=$1 size=$2 dest=$3
shift 3
common="--set cluster.num_workers=2 --set cluster.num_spares=2 --set cluster.gpus_per_actor=0.5
 --set cluster.cpus_per_actor=1 --set fault_tolerance.min_step_timeout_s=60
 --set fault_tolerance.health_timeout_s=10
 --set checkpoint.uri=/tmp/gpu_demo/$name/checkpoints --set run_dir=/tmp/gpu_demo/$name"
case $size in
  small) model="--set model.num_layers=4 --set model.hidden_size=256 --set model.num_heads=8
 --set model.ffn_hidden_size=512 --set model.vocab_size=1000 --set model.max_seq_len=128
 --set train.seq_len=128 --set train.global_batch_size=8 --set train.mini_batch_size=4
 --set train.micro_batch_size=1" ;;
  medium) model="--set model.num_layers=8 --set model.hidden_size=1024 --set model.num_heads=16
 --set model.ffn_hidden_size=2816 --set model.vocab_size=32000 --set model.max_seq_len=1024
 --set train.seq_len=1024 --set train.global_batch_size=8 --set train.mini_batch_size=4
 --set train.micro_batch_size=1 --set train.lr=0.0001" ;;
  1b) model="$MODEL_1B --set train.global_batch_size=8 --set train.mini_batch_size=4
 --set train.micro_batch_size=1" ;;
  *) echo "size must be small, medium or 1b" >&2; exit 2 ;;
esac
mkdir -p "$dest"
cmd="python3 main.py demo --summary $dest/$name.json $(echo $common $model) $*"
echo "$cmd" > "$dest/$name.cmd"
echo "== $name: $cmd"
PYTHONUNBUFFERED=1 timeout "${DEMO_TIMEOUT:-300}" $cmd 2>&1 | tee "$dest/$name.log" \
  | grep -E "^ *[0-9]+ |recovery|detect|abort|replace|rebuild|restore|first_step|total|losses|Error|error" | tail -40
echo "== $name exit ${PIPESTATUS[0]}"
