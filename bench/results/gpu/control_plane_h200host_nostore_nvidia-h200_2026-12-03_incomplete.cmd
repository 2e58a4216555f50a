python3 -m bench.control_plane --sizes 64 256 1024 --no-store (timeout 540 s: killed before N=64 printed a row)
