python -m bench.control_plane --sizes 32 64 128 --ranks-per-node 4 --fanout 4 --direct --no-store --steps 10 --idle-s 3 --phase-timeout-s 300 --out bench/results/control_plane_cpu_fanout.json
