#!/usr/bin/env bash
# RL on a prompt set with the Megatron engine (pad / stop ids from the tokenizer through
# `generate` / `sample_rollouts`): the GPU tests of tests/rl/test_megatron_rl.py, then GRPO on the
# generated arithmetic prompt set (configs/grpo_cpu.yaml on 2 GPUs, 20 steps) with a kill at step 8
# inside the all-reduce; keeps NAME.cmd / NAME.log in DEST.
# Usage (repo root, GPU machine, 2 GPUs): bash bench/results/gpu/run_prompts_rl.sh DEST
set -o pipefail
source "$(dirname "$0")/bench_lib.sh"
dest=${1:-bench/results/gpu}
keep_run pytest_gpu_rl_prompts "$dest" 900 15 "python -m pytest -q -m gpu tests/rl/test_megatron_rl.py"
python main.py data stdlib --output-dir /tmp/gpu_prompts/corpus --max-files 40 > /dev/null
python main.py data arithmetic --plain --output /tmp/gpu_prompts/train.parquet > /dev/null
keep_run grpo_prompts_megatron "$dest" 900 25 "python main.py train --config configs/grpo_cpu.yaml --fresh
 --set data.path=/tmp/gpu_prompts/train.parquet --set data.tokenizer=/tmp/gpu_prompts/corpus/tokenizer
 --set cluster.device=cuda --set cluster.gpus_per_actor=0.5 --set model.distributed_optimizer=false
 --set train.steps=20 --set run_dir=/tmp/gpu_prompts/run --set checkpoint.uri=/tmp/gpu_prompts/run/ckpt
 --set chaos.events=[{\"step\":8,\"rank\":0,\"kind\":\"kill\",\"point\":\"inside_allreduce\"}]"
