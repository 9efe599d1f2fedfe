# Every target installs the project into $(VENV) on first use: a fresh machine needs only
# Python and make. Override PYTHON/VENV to use another interpreter, ARGS to pass flags.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
ARGS   ?=
PRESET ?= tiny

.DEFAULT_GOAL := help
.PHONY: help train test bench dry-run prepare clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

train: $(VENV)/.installed  ## train the tiny model on the embedded corpus (resumes if run again)
	$(PY) train_dense.py $(PRESET) $(ARGS)

test: $(VENV)/.installed  ## run the test suite on 8 simulated CPU devices
	$(PY) -m pytest -n 2 tests $(ARGS)

bench: $(VENV)/.installed  ## tokens/s, ms/step, MFU and compile time of PRESET on synthetic tokens
	$(PY) train_dense.py $(PRESET) --bench 10 $(ARGS)

dry-run: $(VENV)/.installed  ## compile llama3.1-70b on 256 simulated devices and print its memory
	XLA_FLAGS=--xla_force_host_platform_device_count=256 $(PY) train_dense.py llama3.1-70b \
	  --dry-run --mesh.fsdp 256 $(ARGS)

prepare: $(VENV)/.installed  ## tokenize your own text: make prepare ARGS="--input my.txt --out data/mine"
	$(PY) -m common.data prepare $(ARGS)

clean:  ## remove the virtual environment (runs/ and data/ are yours: never touched)
	rm -rf $(VENV)
