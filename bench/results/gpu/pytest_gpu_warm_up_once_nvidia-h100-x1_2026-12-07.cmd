# device: nvidia-h100-x1 (NVIDIA H100 80GB HBM3), 2026-12-07: a spare warms up once (issue 59 item 2)
source .gpu/install.sh .gpu
python3 -m pytest -m gpu tests/engines/test_megatron_engine.py -k "warm_up" -q -rs -p no:cacheprovider
# result: 1 passed (test_spare_warm_up_leaves_no_trace, with warmed_once), 22 deselected in 43.55 s
