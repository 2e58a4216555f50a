# Image for the GPU job (Anyscale `containerfile:` in job.yaml, or KubeRay).
# Base: NVIDIA's NGC PyTorch image, which ships torch, Transformer Engine, Apex, cuDNN and NCCL
# built and tested together, so the engine takes Transformer Engine's layer spec (fused
# attention, norm + linear, context parallelism) and Megatron's fused Adam. Why not a pinned
# `transformer_engine[pytorch]` on top of our torch: its PyTorch extension compiles against
# the installed torch at install time (CUDA toolkit and 20+ minutes), and a mismatch fails at
# import. Megatron-Core recommends the NGC release of the month before its own; Python 3.12.
# The CPU install path (run.sh, requirements*.txt) stays free of TE and CUDA wheels.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.12-py3
FROM ${BASE_IMAGE}
WORKDIR /home/ray/app
COPY requirements.txt .
# Keep the base's torch (TE and Apex are built against it): install everything else pinned.
# PIP_CONSTRAINT is NGC's global pin list, which would refuse our pins (Megatron's docs unset it too).
RUN grep -v '^torch==' requirements.txt > /tmp/requirements-no-torch.txt \
    && PIP_CONSTRAINT= pip install --no-cache-dir -r /tmp/requirements-no-torch.txt \
    && python -c "import transformer_engine.pytorch, torch; print('TE', transformer_engine.__version__, 'torch', torch.__version__)"
COPY . .
# The library (ftrain/) installed in place, its dependencies already there: importable from anywhere.
RUN PIP_CONSTRAINT= pip install --no-cache-dir --no-deps -e .
# NVLink multicast off on shared hosts (see README).
ENV NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# `docker run --gpus all IMAGE`: the GPU demo on a local Ray (4 workers + 4 spares at 0.5 GPU:
# 4 GPUs). job.yaml and deploy/rayjob.yaml replace this with an entrypoint that joins the cluster.
CMD ["python", "main.py", "demo", "--set", "cluster.gpus_per_actor=0.5", "--set", "cluster.cpus_per_actor=1"]
