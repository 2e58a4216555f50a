python3 -m bench.profile_step --micro-batch 4 --out-dir /root/out
