python -m bench.control_plane --sizes 64 128 --no-store --out bench/results/control_plane_cpu2_nostore.json  # 2-core CPU machine shared with other jobs; 256 did not fit its free memory
