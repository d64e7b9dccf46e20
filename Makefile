# weightsync developer targets. Every target that needs the environment depends on `setup`, which is
# idempotent and fast once the virtualenv and the control-plane binaries are cached.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
PYTEST_ARGS ?=
# The engine releases the adapters follow; their code is imported by the `engines` test tier (pip's cache
# keeps the wheels between runs, outside the repository).
ENGINES := sglang==0.5.23 vllm==0.33.0
# constraints.txt is the one lock: the venv (tests) and the images (Dockerfile) install the same versions.
LOCK := constraints.txt
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile $(LOCK) | sha1sum | cut -c1-12)

.PHONY: setup binaries engine-venv bytecode lock test test-engines test-engine-servers test-unit e2e e2e-images demo bench crds docs troubleshooting-doc lint dev-up dev-down dev-status clean image base-image image-lint

setup: $(STAMP) binaries engine-venv bytecode

## bytecode: the repository's own modules byte-compiled once (a clean clone has none, and with
## PYTHONDONTWRITEBYTECODE set, as on CI, every agent, operator and demo process the tests start would compile
## them again: about 1 s of CPU per process start on a 2-core machine). Only stale files are rewritten.
bytecode: $(STAMP)
	$(VPY) -m compileall -q -j0 agent crds operator e2e weightsync bench >/dev/null

## engine-venv: the real engine servers' venv (vLLM's CPU build 0.32.0, SGLang 0.5.23, their torch) outside the
## repository (~/.cache/weightsync/engine-venv-*, ~6 GB, about 3 min cold); the `engine_servers` tier and the
## local cluster's vLLM / SGLang engine containers run in it.
engine-venv:
	bash e2e/scripts/engine-venv.sh >/dev/null

$(STAMP): pyproject.toml $(LOCK)
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --upgrade pip >/dev/null
	$(VPY) -m pip install --constraint $(LOCK) -e '.[agent,gdr,dev,engines]'
	$(VPY) -m pip install --constraint $(LOCK) --no-deps $(ENGINES)
	touch $@

## lock: rewrite constraints.txt from the venv (after changing pyproject.toml's dependencies or ENGINES).
lock: $(STAMP)
	{ sed -n '1,/^[^#]/{/^#/p}' $(LOCK); $(VPY) -m pip freeze --all --exclude-editable | grep -v '^pip=='; } > $(LOCK).new && mv $(LOCK).new $(LOCK)

binaries:
	bash e2e/scripts/build-binaries.sh >/dev/null

## test: every CI test (unit, agent multi-process, control plane, e2e); GPU tests are deselected.
## (`kind` tests need a kind GPU cluster: e2e/kind/run-e2e.sh runs them.)
test: setup
	$(VENV)/bin/pytest -m 'not gpu and not kind and not images' --durations=25 $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(VENV)/bin/pytest -m 'not gpu and not cluster and not e2e and not kind and not engine_servers' $(PYTEST_ARGS)

## test-engines: the adapters against the engines' own released code (part of `make test` too).
test-engines: $(STAMP)
	$(VENV)/bin/pytest -m engines $(PYTEST_ARGS)

## test-engine-servers: the engines' own servers answer real agents (part of `make test` too).
test-engine-servers: $(STAMP) engine-venv
	$(VENV)/bin/pytest -m engine_servers $(PYTEST_ARGS)

test-gpu: $(STAMP)
	$(VENV)/bin/pytest -m gpu $(PYTEST_ARGS)

e2e: setup
	$(VENV)/bin/pytest -m e2e $(PYTEST_ARGS)

## demo: the README demo (helm-installed operator, live table of versions); DEMO_ARGS=--keep keeps it running.
DEMO_ARGS ?=
demo: setup
	PYTHONUNBUFFERED=1 $(VPY) -m weightsync.e2e.demo_cli $(DEMO_ARGS)

## bench: every benchmark, one JSON file each in bench/results/ (ratios against a raw reference in the same run).
bench: setup
	mkdir -p bench/results
	$(VPY) bench/transport_ratio.py --transport nccl --size-mb 1024 --json | tee bench/results/nccl.json
	$(VPY) bench/transport_ratio.py --transport ipc --size-mb 1024 --json | tee bench/results/ipc.json
	$(VPY) bench/transport_ratio.py --transport gdr --size-mb 1024 --json | tee bench/results/gdr.json
	$(VPY) bench/transport_ratio.py --transport gdr --size-mb 256 --iters 3 --verify --delta-fraction 0.05 --json | tee bench/results/gdr-verify-delta.json
	$(VPY) bench/status_latency.py --versions 50 --pods 8 | tee bench/results/status-latency.json
	$(VPY) bench/agent_pipeline.py --mode nccl --size-mb 1024 --json | tee bench/results/agent-pipeline-nccl.json
	$(VPY) bench/agent_pipeline.py --mode ipc --size-mb 1024 --json | tee bench/results/agent-pipeline-ipc.json
	$(VPY) bench/agent_pipeline.py --mode gdr --size-mb 1024 --json | tee bench/results/agent-pipeline-gdr.json
	$(VPY) bench/agent_pipeline.py --mode nccl --size-mb 1024 --fsdp 2 --inference-tp 2 --json | tee bench/results/agent-pipeline-nccl-fsdp2-tp2.json
	$(VPY) bench/agent_pipeline.py --mode gdr --size-mb 1024 --fsdp 2 --inference-tp 2 --json | tee bench/results/agent-pipeline-gdr-fsdp2-tp2.json
	$(VPY) bench/agent_pipeline.py --mode ipc --size-mb 1024 --fsdp 2 --inference-tp 2 --json | tee bench/results/agent-pipeline-ipc-fsdp2-tp2.json
	$(VPY) bench/agent_pipeline.py --mode nccl --size-mb 1024 --dp 2 --json | tee bench/results/agent-pipeline-nccl-dp2.json
	$(VPY) bench/agent_pipeline.py --mode nccl --size-mb 1024 --tensors 16384 --json | tee bench/results/agent-pipeline-nccl-moe16384.json
	$(VPY) bench/agent_pipeline.py --mode ipc --size-mb 1024 --tensors 16384 --json | tee bench/results/agent-pipeline-ipc-moe16384.json
	$(VPY) bench/agent_pipeline.py --mode gdr --size-mb 1024 --tensors 16384 --json | tee bench/results/agent-pipeline-gdr-moe16384.json
	$(VPY) bench/agent_pipeline.py --mode nccl --size-mb 1024 --fsdp 2 --inference-tp 2 --tensors 16384 --json | tee bench/results/agent-pipeline-nccl-fsdp2-tp2-moe16384.json
	$(VPY) bench/agent_pipeline.py --mode nccl --size-mb 256 --json | tee bench/results/agent-pipeline-nccl-256.json
	$(VPY) bench/agent_pipeline.py --mode nccl --size-mb 256 --replicas 3 --fan-out direct --versions 4 --json | tee bench/results/agent-pipeline-nccl-256-replicas3-direct.json
	$(VPY) bench/agent_pipeline.py --mode nccl --size-mb 256 --replicas 3 --fan-out relay --versions 4 --json | tee bench/results/agent-pipeline-nccl-256-replicas3-relay.json
	$(VPY) bench/agent_pipeline.py --mode nccl --size-mb 256 --staging ring --json | tee bench/results/agent-pipeline-ring-nccl-256.json
	$(VPY) bench/agent_pipeline.py --mode nccl --size-mb 1024 --staging ring --json | tee bench/results/agent-pipeline-ring-nccl-1024.json
	$(VPY) bench/engine_stall.py --engine vllm --size-mb 1024 --json | tee bench/results/engine-stall-vllm.json
	$(VPY) bench/plan_scale.py --tensors 70000 --ranks 256 --json | tee bench/results/plan-scale.json
	$(VPY) bench/layouts.py --preset llama-gqa --trainer-tp 2 --trainer-fsdp 2 --inference-tp 16 --json | tee bench/results/layouts-llama-gqa.json
	$(VPY) bench/layouts.py --preset megatron-fused --trainer-tp 2 --trainer-pp 2 --inference-tp 16 --json | tee bench/results/layouts-megatron-fused.json
	$(VPY) bench/layouts.py --preset fsdp2-tp-strided --trainer-tp 2 --trainer-fsdp 2 --inference-tp 4 --json | tee bench/results/layouts-fsdp2-tp-strided.json
	$(VPY) bench/layouts.py --preset qwen-moe --trainer-tp 2 --trainer-ep 4 --inference-tp 4 --inference-ep 2 --json | tee bench/results/layouts-qwen-moe.json
	$(VPY) bench/layouts.py --preset deepseek-fp8 --fp8 --trainer-tp 2 --trainer-ep 2 --inference-tp 4 --inference-ep 4 --json | tee bench/results/layouts-deepseek-fp8.json
	$(VPY) bench/operator_scale.py --replicas 8 32 64 | tee bench/results/operator-scale.json
	$(VPY) bench/operator_scale.py --nodes 1000 --pods 2000 --jobs 100 --json | tee bench/results/operator-fleet.json
	$(VPY) bench/status_write.py --json | tee bench/results/status-write.json
	$(VPY) bench/process_runtime.py --pods 8 | tee bench/results/process-runtime.json

crds: $(STAMP)
	$(VPY) -m weightsync.crds.generate

## docs: regenerate docs/api-reference.md from the models (CI: python -m weightsync.crds.docs --check).
docs: $(STAMP)
	$(VPY) -m weightsync.crds.docs

## troubleshooting-doc: rewrite docs/troubleshooting.md from real jobs on the embedded local cluster (a few minutes).
troubleshooting-doc: setup
	$(VPY) -m weightsync.e2e.troubleshooting --out docs/troubleshooting.md

lint: $(STAMP)
	$(VPY) -m ruff check --no-cache .  # the cache does not key on which packages are first-party
	$(VPY) -m mypy
	$(VENV)/bin/lint-imports --no-cache --no-logo pyproject.toml
	$(VENV)/bin/pytest -q -p no:cacheprovider tests/lint/test_import_cycles.py

dev-up: setup
	$(VPY) -m weightsync.e2e.cli up

dev-down:
	$(VPY) -m weightsync.e2e.cli down

dev-status:
	$(VPY) -m weightsync.e2e.cli status

clean:
	rm -rf .dev build *.egg-info

## image: both images from the one Dockerfile (`--target operator`, `--target agent`) with Docker, or with
## buildah where no Docker engine runs (images/build.sh; BUILDER=docker|buildah forces one). Defaults: the
## chart's image repositories and appVersion, so `helm install` finds them. IMAGE_TARGETS="operator" builds
## one. Sizes and each image's `pip freeze` land in build/images/.
## base-image: a python3.11 base from Debian's packages (debootstrap) for machines that cannot pull the pinned
## one: `make base-image image PYTHON_IMAGE=$(BASE_IMAGE)`.
DOCKER ?= docker
BASE_IMAGE ?= localhost/weightsync-base:bookworm-py311
IMAGE_TARGETS ?= operator agent
CHART_DIR := helm/weightsync-operator
IMAGE_TAG ?= $(shell sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$$/\1/p' $(CHART_DIR)/Chart.yaml)
OPERATOR_IMAGE_REPO ?= ghcr.io/weightsync/weightsync-operator
AGENT_IMAGE_REPO ?= ghcr.io/weightsync/weightsync-agent
OPERATOR_IMAGE ?= $(OPERATOR_IMAGE_REPO):$(IMAGE_TAG)
AGENT_IMAGE ?= $(AGENT_IMAGE_REPO):$(IMAGE_TAG)
PYTHON_IMAGE ?=
IMAGE_BUILD_ARGS ?=
image: image-lint
	TARGETS="$(IMAGE_TARGETS)" OPERATOR_IMAGE=$(OPERATOR_IMAGE) AGENT_IMAGE=$(AGENT_IMAGE) VERSION=$(IMAGE_TAG) \
	  PYTHON_IMAGE=$(PYTHON_IMAGE) IMAGE_BUILD_ARGS="$(IMAGE_BUILD_ARGS)" bash images/build.sh
	@echo "built $(foreach t,$(IMAGE_TARGETS),$(if $(filter operator,$(t)),$(OPERATOR_IMAGE),$(AGENT_IMAGE)))"

print-base-image:
	@echo $(BASE_IMAGE)

base-image:
	BASE_IMAGE=$(BASE_IMAGE) bash images/base-image.sh

## e2e-images: build both images (on the base from Debian's packages unless PYTHON_IMAGE names one that can
## be pulled), check their hygiene, then install the chart with them and run the demo job with the operator,
## every agent and the demo trainer / engines started from the images (the process runtime's image mode).
e2e-images: setup
	$(if $(PYTHON_IMAGE),,$(MAKE) --no-print-directory base-image)
	$(MAKE) --no-print-directory image PYTHON_IMAGE=$(or $(PYTHON_IMAGE),$(BASE_IMAGE))
	WEIGHTSYNC_IMAGE_TARGETS="$(IMAGE_TARGETS)" $(VENV)/bin/pytest -m images tests/docker/test_built_images.py $(PYTEST_ARGS)
	WEIGHTSYNC_RUNTIME_IMAGES=buildah $(VENV)/bin/pytest -m images e2e/tests/test_images.py $(PYTEST_ARGS)

## image-lint: hadolint and the repository's Dockerfile rules (no Docker engine needed; CI runs the same tests).
image-lint: $(STAMP)
	$(VENV)/bin/hadolint --failure-threshold info Dockerfile
	$(VENV)/bin/pytest -q -p no:cacheprovider tests/docker/test_dockerfile.py
