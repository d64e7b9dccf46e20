# weightsync developer targets. Every target that needs the environment depends on `setup`, which is
# idempotent and fast once the virtualenv and the control-plane binaries are cached.
SHELL := /bin/bash
# `python -m` from the repository root would put the root on sys.path, and the root's `operator/`
# folder would shadow the standard library's operator module (Python >= 3.11 honours this).
export PYTHONSAFEPATH := 1
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
PYTEST_ARGS ?=
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: setup binaries test test-unit e2e demo bench crds docs lint dev-up dev-down dev-status clean

setup: $(STAMP) binaries

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --upgrade pip >/dev/null
	$(VPY) -m pip install -e '.[agent,gdr,dev]'
	touch $@

binaries:
	bash e2e/scripts/build-binaries.sh >/dev/null

## test: every CI test (unit, agent multi-process, control plane, e2e); GPU tests are deselected.
test: setup
	$(VENV)/bin/pytest -m 'not gpu' $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(VENV)/bin/pytest -m 'not gpu and not cluster and not e2e' $(PYTEST_ARGS)

test-gpu: $(STAMP)
	$(VENV)/bin/pytest -m gpu $(PYTEST_ARGS)

e2e: setup
	$(VENV)/bin/pytest -m e2e $(PYTEST_ARGS)

demo: setup
	$(VPY) -m weightsync.e2e.demo

## bench: every benchmark, one JSON file each in bench/results/ (ratios against a raw reference in the same run).
bench: setup
	mkdir -p bench/results
	$(VPY) -m weightsync.agent.bench --transport nccl --size-mb 1024 --json | tee bench/results/nccl.json
	$(VPY) -m weightsync.agent.bench --transport ipc --size-mb 1024 --json | tee bench/results/ipc.json
	$(VPY) -m weightsync.agent.bench --transport gdr --size-mb 1024 --json | tee bench/results/gdr.json
	$(VPY) -m weightsync.agent.bench --transport gdr --size-mb 256 --iters 3 --verify --delta-fraction 0.05 --json | tee bench/results/gdr-verify-delta.json
	$(VPY) bench/status_latency.py --versions 50 --pods 8 | tee bench/results/status-latency.json
	$(VPY) bench/operator_scale.py --replicas 8 32 64 | tee bench/results/operator-scale.json
	$(VPY) -m weightsync.e2e.runtime.bench --pods 8 | tee bench/results/process-runtime.json

crds: $(STAMP)
	$(VPY) -m weightsync.crds.generate

## docs: regenerate docs/api-reference.md from the models (CI: python -m weightsync.crds.docs --check).
docs: $(STAMP)
	$(VPY) -m weightsync.crds.docs

lint: $(STAMP)
	$(VPY) -m ruff check .
	$(VPY) -m mypy crds operator agent e2e weightsync

dev-up: setup
	$(VPY) -m weightsync.e2e.cli up

dev-down:
	$(VPY) -m weightsync.e2e.cli down

dev-status:
	$(VPY) -m weightsync.e2e.cli status

clean:
	rm -rf .dev build *.egg-info
