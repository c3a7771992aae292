# Two commands do all set-up on a fresh machine:
#   make run   - create the venv, install Switchyard, run the demo (router + 4 simulated workers + a workload)
#   make test  - create/update the venv with test extras, install the tests' system prerequisites, run the suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMPS := .stamps
PIP := $(BIN)/pip --disable-pip-version-check -q
SRC := pyproject.toml setup.py $(wildcard protos/switchyard/v1/*.proto) $(wildcard ext/*.pyx ext/*.pxd)

.PHONY: run test install install-test sysdeps lint bench-sim bench-live bench-profiles clean

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
	touch $@

install: $(STAMPS)/install
install-test: $(STAMPS)/install-test

# System packages the tests use: a real Prometheus server for the metrics test.
sysdeps:
	@command -v prometheus >/dev/null 2>&1 || { \
	  echo "installing Debian packages: prometheus"; \
	  SUDO=$$(command -v sudo >/dev/null 2>&1 && [ "$$(id -u)" != 0 ] && echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

run: install
	$(BIN)/switchyard demo

test: install-test sysdeps
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -ra

lint: install-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench-profiles: install
	$(BIN)/switchyard bench profiles

bench-sim: install
	$(BIN)/switchyard bench sim --trace mooncake-conversation --workers 8 --policies round_robin,least_request,power_of_two

bench-live: install
	$(BIN)/switchyard bench live

clean:
	rm -rf $(VENV) $(STAMPS) build *.egg-info switchyard/v1 ext/*.c ext/*.so
