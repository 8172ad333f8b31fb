# detjac: `make demo` and `make test` work on a fresh machine with Python 3.11.
# TORCH_SPEC picks the PyTorch build installed first (default: the CPU wheel 2.13.0).
# For a GPU machine, e.g.:  make test TORCH_SPEC="torch==2.13.0 --index-url <your CUDA wheel index>"
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.detjac-installed

.PHONY: demo test install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/detjac demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
