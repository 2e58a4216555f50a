python -m bench.control_plane --sizes 16 128 --no-store --fanout 4 --steps 10 --idle-s 1 --phase-timeout-s 400 --out bench/results/control_plane_cpu_fanout4.json
