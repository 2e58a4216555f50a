# checkpoint_write_path_cpu*.json: one campaign on the 2-core shared CPU machine, 2026-12-01, in this order.
# "before": the code of commit 82d15a0 (git archive 82d15a0 | tar -x -C before), with this branch's final
# bench/write_path.py copied in and one line appended to its checkpoint.py, `no_zip_crc32 = _no_zip_crc32`
# (the later name the bench imports). Repository root / before's root, .venv's python.
for round in 1 2; do   # round 1 -> *_r1.json, round 2 -> the files without a suffix
  (cd before && python -m bench.write_path --repeat 4 --out checkpoint_write_path_cpu_before[_r1].json)
  python -m bench.write_path --repeat 4 --out bench/results/checkpoint_write_path_cpu[_r1].json
done
