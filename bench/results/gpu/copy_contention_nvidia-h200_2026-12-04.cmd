python3 -m bench.copy_contention --gb 4.8 --reps 5 --out bench/results/gpu/copy_contention_nvidia-h200_2026-12-04.json
