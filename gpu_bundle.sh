#!/usr/bin/env bash
# Build the folder of Python packages the GPU test machine lacks: Ray and Megatron-Core
# (../shared/gpu/make_bundle.sh) plus mbridge (HF checkpoints in the Megatron engine,
# model.hf_path; the machine's image has transformers, safetensors and einops already).
# Usage, from anywhere:  bash gpu_bundle.sh [DEST]   (DEST default: .gpu, relative to the repo root)
# Then carry DEST with the device run and start its command with:  source DEST/install.sh DEST
set -euo pipefail
cd "$(dirname "$0")"
DEST=${1:-.gpu}
bash ../shared/gpu/make_bundle.sh "$DEST"
MBRIDGE_VERSION=$(sed -n 's/^mbridge==\([^ #]*\).*/\1/p' requirements.txt)
python3 -m pip download -q --no-deps "mbridge==${MBRIDGE_VERSION:?no mbridge pin in requirements.txt}" -d "$DEST" 2>&1 \
    | grep -v '^WARNING: Location' || true
ls "$DEST"/mbridge-"$MBRIDGE_VERSION"-*.whl >/dev/null  # fails the script if the download did not happen
ls -la "$DEST"
