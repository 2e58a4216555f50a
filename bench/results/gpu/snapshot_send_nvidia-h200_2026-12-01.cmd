python3 -m bench.snapshot_send --gb 1 4 --sends 5 --object-store-gb 8 --out /root/out/snapshot_send_nvidia-h200_2026-12-01.json
