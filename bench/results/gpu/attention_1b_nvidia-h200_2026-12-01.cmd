python3 -m bench.attention --micro-batch 2 --repeats 10 --out $OUT/attention_1b_nvidia-h200_2026-12-01.json
