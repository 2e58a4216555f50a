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

# The GCS client and a loopback GCS emulator for the GPU test of object-storage checkpoints
# (tests/test_megatron_engine.py, backend gcs; the image lacks them). Versions as in the CPU venv.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DEST" \
    fsspec==2026.9.0 gcsfs==2026.10.1 gcp-storage-emulator==2026.7.19 google-auth==2.63.0 google-auth-oauthlib==1.5.0 \
    google-cloud-storage==3.17.1 google-cloud-storage-control==1.17.0 google-api-core==2.44.0 \
    google-cloud-core==2.8.0 google-crc32c==1.9.0 google-resumable-media==2.11.0 pyasn1-modules==0.4.2 \
    pyasn1==0.6.5 requests-oauthlib==2.0.0 oauthlib==4.0.1 decorator==5.3.1 googleapis-common-protos==1.76.0 \
    proto-plus==1.29.0 grpc-google-iam-v1==0.14.6 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 2>&1 \
    | grep -v '^WARNING: Location' || true
ls "$DEST"/gcsfs-*.whl "$DEST"/gcp_storage_emulator-*.whl >/dev/null
du -sh "$DEST"
