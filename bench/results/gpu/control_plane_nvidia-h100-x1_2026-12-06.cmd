python3 -m bench.control_plane --sizes 64 1024 --no-store --steps 10 --idle-s 3 --phase-timeout-s 420 --out bench/results/gpu/control_plane_nvidia-h100-x1_2026-12-06.json
