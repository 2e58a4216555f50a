# Image for the GPU job (Anyscale `containerfile:` in job.yaml, or KubeRay).
# Base: Ray 2.60 with CUDA; torch comes as the CUDA build of the pinned release.
FROM anyscale/ray:2.60.0-py311-cu128
WORKDIR /home/ray/app
COPY requirements.txt .
RUN pip install --no-cache-dir -r requirements.txt
COPY . .
# NVLink multicast off on shared hosts (see README).
ENV NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# `docker run --gpus all IMAGE`: the GPU demo on a local Ray (4 workers + 4 spares at 0.5 GPU:
# 4 GPUs). job.yaml and deploy/rayjob.yaml replace this with an entrypoint that joins the cluster.
CMD ["python", "main.py", "demo", "--set", "cluster.gpus_per_actor=0.5", "--set", "cluster.cpus_per_actor=1"]
