#!/usr/bin/env bash
# Quick start.  `bash run.sh`: set up .venv (if needed) and run the demo.
#               `bash run.sh test`: same set-up, then the test suite (two modules at a time; `-n 0`: serial).
#               `bash run.sh train|demo [args]`: pass arguments to main.py.
# Torch: the CUDA build where nvidia-smi sees a GPU, else the CPU build. On a CPU machine
# without a local CPU wheel, set PIP_TORCH_INDEX=https://download.pytorch.org/whl/cpu to avoid
# downloading the CUDA build.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then flavour=cuda; else flavour=cpu; fi
stamp=".venv/.installed-$flavour-$(cat requirements.txt requirements-dev.txt pyproject.toml | sha256sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  if [ "$flavour" = cpu ]; then
    .venv/bin/python -m pip install -q "torch==2.13.0" ${PIP_TORCH_INDEX:+--index-url "$PIP_TORCH_INDEX"}
  fi
  .venv/bin/python -m pip install -q -r requirements-dev.txt
  .venv/bin/python -m pip install -q --no-deps -e .  # the library, ftrain/: importable from anywhere
  touch "$stamp"
fi
mode=${1:-demo}
[ $# -gt 0 ] && shift
if [ "$mode" = test ]; then
  # Two xdist workers, each given whole modules (a module shares one local Ray, conftest's
  # ray_session) in collection order (conftest: longest first); tests spend much of their time
  # waiting on deadlines and timeouts, so two of them keep the two cores busy.
  exec .venv/bin/python -m pytest tests -q --durations=15 -n 2 --dist loadfile --no-loadscope-reorder "$@"
fi
exec .venv/bin/python main.py "$mode" "$@"
