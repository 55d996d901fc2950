# kubeinfer — every target sets up what it needs. See README.md.
SHELL := /usr/bin/env bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
CACHE := $(HOME)/.cache/kubeinfer
TIMED := hack/timed.sh
MODEL_DIR := .cache/models/smollm2-135m
# pip's own cache (~/.cache/pip) serves torch's several-GB wheels on a warm machine.
VENV_STAMP := $(VENV)/.kubeinfer-installed

.PHONY: help venv model demo demo-offline test lint pytest bench clean controlplane e2e-kind

help:
	@echo "make demo    - dev cluster, helm install, SmolLM2 autoscaled under load (DEMO_KEEP=0 to tear down)"
	@echo "make demo-offline - one answer from the engine, no cluster"
	@echo "make test    - set up and run every test (ruff + pytest)"
	@echo "make model   - SmolLM2-135M-Instruct in HF format under $(MODEL_DIR)"
	@echo "make bench   - run the benchmarks in bench/"
	@echo "make lint    - ruff"
	@echo "make controlplane - build etcd, kube-*, kubectl, helm once into $(CACHE)/bin/<k8s-version>/"
	@echo "make e2e-kind - kind cluster, both images, helm install, examples/ (needs Docker and kind)"

$(VENV_STAMP): pyproject.toml
	@$(TIMED) venv bash -c '\
	  set -e; [ -x $(PY) ] || $(PYTHON) -m venv $(VENV); \
	  $(PIP) install -q --upgrade pip "setuptools>=69" wheel; \
	  $(PIP) install -q -e ".[runtime,test]"'
	@touch $@

venv: $(VENV_STAMP)

# The converted model is cached under ~/.cache/kubeinfer/models and linked into .cache/models.
model: venv
	@$(TIMED) model $(PY) hack/make_model.py --cache $(CACHE)/models --out $(MODEL_DIR)

# The whole story on the dev cluster (hack/demo.py); DEMO_KEEP=0 tears the cluster down after.
DEMO_KEEP ?= 1
demo: venv model controlplane
	@DEMO_KEEP=$(DEMO_KEEP) $(TIMED) demo $(VENV)/bin/python hack/demo.py

# The offline path only: one answer from the engine, no cluster.
demo-offline: venv model
	@$(TIMED) demo-offline $(VENV)/bin/kubeinfer generate --model $(MODEL_DIR) --max-tokens 32 \
	  "What is the capital of France?"

lint: venv
	@$(TIMED) ruff $(VENV)/bin/ruff check .

# The dev cluster's binaries, built from our Go wrapper modules through the module proxy and
# reused while present (a cold build takes ~16 min on 2 cores). The k8s version is the one
# hack/controlplane/kubernetes/go.mod requires.
controlplane:
	@$(TIMED) controlplane hack/controlplane/build.sh

# pytest exits 5 when no test ran: that is a failure here, never a silent pass.
pytest: venv model controlplane
	@$(TIMED) pytest $(PY) -m pytest -q

test: lint pytest

bench: venv model
	@$(TIMED) bench-loader $(PY) bench/loader.py
	@$(TIMED) bench-scheduler $(PY) bench/scheduler.py
	@$(TIMED) bench-sampler $(PY) bench/sampler.py
	@$(TIMED) bench-throughput $(PY) bench/throughput.py
	@$(TIMED) bench-serve $(PY) bench/serve.py
	@$(TIMED) bench-overload $(PY) bench/overload.py
	@$(TIMED) bench-peer-vllm $(PY) bench/peer_vllm.py --served
	@$(TIMED) bench-autoscale $(PY) bench/autoscale_sim.py --png docs/autoscale_sim.png
	@$(PY) hack/readme_sections.py  # the README shows the latest row of each

# Machines with Docker only: the script checks for docker, kind, kubectl and helm before
# anything slow and says what is missing (it cannot run on the Docker-less dev machine).
e2e-kind:
	@$(TIMED) e2e-kind hack/e2e-kind.sh

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache
