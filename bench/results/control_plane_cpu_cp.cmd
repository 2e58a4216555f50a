# before: main at dd5184e; after: branch cp (same 2-core VM, one run after the other)
python -m bench.control_plane --sizes 32 128 --ranks-per-node 4 --fanout 4 --no-store --steps 20 --idle-s 3 --health-timeout-s 5 --phase-timeout-s 300 --out bench/results/control_plane_cpu_cp.json
