# checkpoint_write_path_cpu_ab_{buffered,direct}.json: the same code (this branch) twice, back to back, 2026-12-01,
# 2-core shared machine; "buffered" with hashed_file's O_DIRECT off (HashedFile writes the same buffers through
# the page cache), through this driver, run from the repository root as  [BUFFERED=1] python ab.py OUT.json :
#   import os, sys; sys.path.insert(0, ".")
#   import hashed_file
#   if os.environ.get("BUFFERED"): hashed_file._O_DIRECT = 0
#   from bench import write_path
#   if __name__ == "__main__": sys.argv = ["x", "--repeat", "4", "--out", sys.argv[1]]; write_path.main()
BUFFERED=1 python ab.py bench/results/checkpoint_write_path_cpu_ab_buffered.json
python ab.py bench/results/checkpoint_write_path_cpu_ab_direct.json
