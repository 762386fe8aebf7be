#!/usr/bin/env bash
# Everything the kernels need checked on a GPU machine, in one call: build the C++ and CUDA
# extensions in place, run the kernel tests (cuda and compiled triton join the torch and cpp
# backends), then the kernel benchmark in fp32 and bf16.  Logs go to $OUT (default gpu_results/).
# Needs torch with CUDA, triton and pytest; megatron-core is not needed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python}
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
if ! "$PYTHON" setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
    tail -60 "$OUT/build.log"
    exit 1
fi
"$PYTHON" -c "from fe_megatron import ops; print('backends:', ops.available_backends())" | tee "$OUT/backends.txt"
"$PYTHON" -m pytest -q -rs tests/test_kernels.py 2>&1 | tee "$OUT/test_kernels.txt"
tests_rc=${PIPESTATUS[0]}
"$PYTHON" benchmarks/bench_kernels.py --repeats 20 2>&1 | tee "$OUT/bench_kernels_fp32.jsonl"
"$PYTHON" benchmarks/bench_kernels.py --repeats 20 --dtype bfloat16 2>&1 | tee "$OUT/bench_kernels_bf16.jsonl"
exit "$tests_rc"
