#!/usr/bin/env bash
# Compile every CUDA source for sm_80 and sm_90 with nvcc, and syntax-check the torch binding against the
# installed torch headers, on a machine without a GPU (CI).  Fails on any compile error.
# Usage: csrc/check_cuda_sources.sh [python]   (the python whose torch headers to use)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${1:-python3}
if ! command -v nvcc >/dev/null 2>&1; then
    echo "check_cuda_sources: nvcc not found; CUDA sources NOT compiled" >&2
    exit "${FE_REQUIRE_NVCC:-0}"
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The flags torch's CUDAExtension adds (no implicit half/bf16 conversions), and the targets
# setup.py builds by default (sm_80 and sm_90).
torch_nvcc_flags=$("$PYTHON" -c "from torch.utils.cpp_extension import COMMON_NVCC_FLAGS; print(' '.join(COMMON_NVCC_FLAGS))")
for source in csrc/cuda/*.cu; do
    # shellcheck disable=SC2086
    nvcc -std=c++20 -O3 --use_fast_math $torch_nvcc_flags \
        -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
        -Xcompiler -Wall -Werror all-warnings -c "$source" -o "$work/$(basename "$source").o"
    echo "check_cuda_sources: $source compiles for sm_80 and sm_90 with torch's extension flags"
done
# The binding: torch's CPU wheel ships the c10/cuda headers but not the one CMake generates.
torch_include=$("$PYTHON" -c "from torch.utils.cpp_extension import include_paths; print(' '.join(include_paths()))")
python_include=$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
mkdir -p "$work/include/c10/cuda/impl"
echo "#pragma once" > "$work/include/c10/cuda/impl/cuda_cmake_macros.h"
cuda_include=$(dirname "$(dirname "$(command -v nvcc)")")/include
for binding in csrc/cuda/*.cpp; do
    # shellcheck disable=SC2046
    c++ -std=c++20 -fsyntax-only -Wall -Werror $(printf -- '-I%s ' $torch_include) -I"$python_include" \
        -I"$work/include" -I"$cuda_include" -I/usr/local/cuda/include \
        -DTORCH_EXTENSION_NAME=_C_cuda -DTORCH_API_INCLUDE_EXTENSION_H "$binding"
    echo "check_cuda_sources: $binding passes the host compiler"
done
