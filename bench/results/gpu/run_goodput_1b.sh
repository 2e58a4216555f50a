#!/usr/bin/env bash
# Issue 59 item 1: bench/goodput.py on one GPU with the defaults only (`defaults_only` in the
# JSON): the ~1.4B GPT of bench_lib.sh's MODEL_1B shape (default learning rate), 1 worker + 1
# spare sharing the GPU, global = mini batch 16, micro-batch 8; failures from a Poisson process
# of mean 60 s (crash / exception / hang 40/40/20 %), injected by wall time into STEPS steps
# (default 200), beside 30 steps without failure and a timed whole-job restart. The compiled
# plain PyTorch loop of the same shape and batch is run first (NAME_plain.json) unless PLAIN
# names such a file already made. Keeps NAME.cmd/.log/.json in DEST; more bench args are
# passed on (e.g. --seed 1 --no-restart); BENCH_TIMEOUT (s) bounds the goodput run.
# Usage (repo root, GPU machine, after `source .gpu/install.sh .gpu`):
#   [PLAIN=FILE] [STEPS=N] bash bench/results/gpu/run_goodput_1b.sh NAME DEST [more bench args]
set -o pipefail
source "$(dirname "$0")/bench_lib.sh"
name=$1 dest=$2
shift 2
shape="--set model.num_layers=24 --set model.hidden_size=2048 --set model.num_heads=16
 --set model.ffn_hidden_size=5632 --set model.vocab_size=32000 --set model.max_seq_len=2048
 --set train.seq_len=2048 --set train.global_batch_size=16 --set train.mini_batch_size=16
 --set train.micro_batch_size=8"
plain=${PLAIN:-$dest/${name}_plain.json}
if [ ! -f "$plain" ]; then
  keep_run "${name}_plain" "$dest" 300 3 "python3 -m bench.reference_llama --compile --rows 16 --steps 8
 --warmup 3 --out $plain $shape"
fi
keep_run "$name" "$dest" "${BENCH_TIMEOUT:-580}" 40 "python3 -m bench.goodput --steps ${STEPS:-200}
 --reference-steps 30 --mtbf-s 60 --plain-from $plain --out $dest/$name.json --set cluster.num_workers=1
 --set cluster.num_spares=1 $shape $*"
