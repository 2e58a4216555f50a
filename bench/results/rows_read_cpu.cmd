python -m bench.rows_read --dir /tmp/dataerr --steps 200 --out bench/results/rows_read_cpu.json  # 2-core VM shared with ~4 other sessions (load average 30-50)
