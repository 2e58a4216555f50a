# 2-core VM shared with other helpers' jobs (load average 20-80 during N=32/64, 80-140 during N=128: single values are noisy).
# Run one after the other, same settings, each with --profile (the calling thread's top functions per steps phase are in the .log):
# before: main at 457684d (agents carry per-rank arguments and every rank's result), from a `git archive` copy:
python -m bench.control_plane --sizes 32 64 128 --steps 20 --idle-s 3 --no-store --phase-timeout-s 400 --profile --out bench/results/control_plane_cpu_node_args_before.json
# after: branch nodeargs at 6737b91 (agents derive their ranks' arguments, answer with collected results and failures only), tp=1 (dp=N: every rank a replica, the most results per step):
python -m bench.control_plane --sizes 32 64 128 --steps 20 --idle-s 3 --no-store --phase-timeout-s 400 --profile --out bench/results/control_plane_cpu_node_args.json
# after, tp=8 (one replica per logical node of 8 ranks: one result per node per step):
python -m bench.control_plane --tp 8 --sizes 32 64 128 --steps 20 --idle-s 3 --no-store --phase-timeout-s 400 --profile --out bench/results/control_plane_cpu_node_args_tp8.json
# final: branch nodeargs at f940dc8 (also: the wait's look in one pass under one lock, collect's cached ranks, the agent's message as one argument), tp=1, N = 32 and 64, load average ~30-45:
python -m bench.control_plane --sizes 32 64 --steps 20 --idle-s 3 --no-store --phase-timeout-s 400 --profile --out bench/results/control_plane_cpu_node_args_final.json
