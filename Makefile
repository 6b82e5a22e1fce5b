# Two entry points: `make demo` (set up, then answer a prompt on the built-in model) and
# `make test` (set up, then run the test suite). Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench clean

setup: $(STAMP)

# torch first, from the pinned CPU wheel: anything that pulls torch before it would
# fetch a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

demo: setup
	$(BIN)/python -m llmd_tools.demo

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python -m llmd_tools.bench_offline

clean:
	rm -rf $(VENV) .cache
