#!/usr/bin/env bash
# bench/train_speed.py, issue 37's speed runs: the 1.36B GPT of bench_lib.sh on ONE H200 with the
# Megatron engine, micro-batch 8, global = mini batch 16 (one optimizer update per step), beside
# the HF Llama reference (eager and torch.compile) in the same run. Two runs:
#   NAME_ce   train.objective=ce on real data: the stdlib corpus (`main.py data stdlib`, made
#             once under $CORPUS), its rows read from the .bin every step;
#   NAME_ppo  one-update PPO on synthetic batches (no old-log-prob pass: ppo.behaviour_pass_needed).
# MFU counts no old-log-prob pass in either (flops.py, r = 0), as the reference's.
# JSON headline: tokens_per_s_vs_compiled, objective, data_kind, mfu, reference_compiled_mfu, device.
# Keeps NAME_{ce,ppo}.cmd/.log/.json in DEST. ONLY=ce or ONLY=ppo runs one of the two.
# Usage (repo root, GPU machine, after `source .gpu/install.sh .gpu`):
#   bash bench/results/gpu/run_train_speed_1b_ce.sh NAME DEST [more bench args]
set -o pipefail
source "$(dirname "$0")/bench_lib.sh"
name=$1 dest=$2
shift 2
corpus=${CORPUS:-/tmp/stdlib_corpus}
[ -f "$corpus/stdlib_text_document.idx" ] || python3 main.py data stdlib --output-dir "$corpus" || exit 1
common="python3 -m bench.train_speed --warmup 1 --steps 6 --max-host-mem 0.75 --lag-timeout 45
 --set cluster.num_workers=1 --set cluster.num_spares=0 --set cluster.gpus_per_actor=1
 --set cluster.cpus_per_actor=1 --set fault_tolerance.min_step_timeout_s=60
 --set fault_tolerance.health_timeout_s=10 $MODEL_1B
 --set train.global_batch_size=16 --set train.mini_batch_size=16 --set train.micro_batch_size=8"
[ "${ONLY:-ce}" = ce ] && keep_run "${name}_ce" "$dest" "${BENCH_TIMEOUT:-540}" 45 "$common --out $dest/${name}_ce.json
 --set train.objective=ce --set data.kind=indexed --set data.path=$corpus/stdlib_text_document
 --set data.tokenizer=$corpus/tokenizer $*"
[ "${ONLY:-ppo}" = ppo ] && keep_run "${name}_ppo" "$dest" "${BENCH_TIMEOUT:-540}" 45 "$common --out $dest/${name}_ppo.json
 --set train.objective=ppo $*"
