"""fe_megatron: FactorEngram memory for Megatron-Core pretraining.

Dependency ranges are the tested matrix (docs/compatibility.md): the oldest end is Python 3.11,
torch 2.13 and megatron-core 0.16.1; the newest is Python 3.12, torch 2.15 and megatron-core 0.19.
Each upper bound is the newest minor release that was tested.

Kernels (install with ``pip install --no-build-isolation -e .`` so the build sees torch):
* ``fe_megatron.ops._C_cpu``: OpenMP C++ kernels, built on every machine for its own
  processor (``-march=native``, as DeepSpeed's CPU ops; ``FE_MEGATRON_CPU_ARCH=x86-64-v2``
  or another ``-march`` value builds for a wider range of machines);
* ``fe_megatron.ops._C_cuda``: CUDA kernels, built where torch has CUDA and a complete CUDA
  toolkit is found (``FE_MEGATRON_CUDA_ARCH`` overrides the target list, default ``8.0;9.0``).
  ``FE_MEGATRON_CUDA=auto`` (default) skips them, saying why, where they cannot be built;
  ``FE_MEGATRON_CUDA=1`` forces the build and fails loudly; ``FE_MEGATRON_CUDA=0`` never builds them.
Without torch at build time nothing is compiled and ``fe_megatron.ops`` uses its torch reference.
"""

import os
import sys

from setuptools import find_packages, setup


def cuda_toolkit_problem(torch, cpp_extension):
    """Why the CUDA kernels cannot be built here, or None when they can."""
    if torch.version.cuda is None:
        return "torch is a CPU build"
    if cpp_extension.CUDA_HOME is None:
        return "no CUDA toolkit found (set CUDA_HOME, or put nvcc on the PATH)"
    header = os.path.join(cpp_extension.CUDA_HOME, "include", "cuda_runtime.h")
    if not os.path.exists(header):
        # torch guesses CUDA_HOME from nvcc's folder, which a wrapper script in /usr/local/bin misleads
        return (f"the CUDA toolkit at {cpp_extension.CUDA_HOME} is incomplete ({header} is missing); "
                "set CUDA_HOME to the toolkit's install folder")
    return None


def kernel_extensions():
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        return [], {}
    openmp = ["-fopenmp"]
    # Vector width decides the speed of the row copies and sums (SSE2 alone is 2x slower).
    arch = [f"-march={os.environ.get('FE_MEGATRON_CPU_ARCH', 'native')}"]
    extensions = [cpp_extension.CppExtension(
        "fe_megatron.ops._C_cpu", ["csrc/cpu/ngram_ops_cpu.cpp", "csrc/cpu/gated_reconstruction_cpu.cpp",
                                   "csrc/cpu/decoding_cpu.cpp"],
        # -ffp-contract=off: no fused multiply-add that the torch reference does not do either
        extra_compile_args=["-O3", "-ffp-contract=off", *arch, *openmp], extra_link_args=openmp)]
    cuda_mode = os.environ.get("FE_MEGATRON_CUDA", "auto").lower()
    if cuda_mode not in ("auto", "0", "1"):
        raise SystemExit(f"FE_MEGATRON_CUDA={cuda_mode!r}: use 1 (build the CUDA kernels or fail), "
                         "0 (never build them) or auto (build them where torch has CUDA and a complete toolkit)")
    problem = cuda_toolkit_problem(torch, cpp_extension) if cuda_mode != "0" else "FE_MEGATRON_CUDA=0"
    if problem is None:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", os.environ.get("FE_MEGATRON_CUDA_ARCH", "8.0;9.0"))
        extensions.append(cpp_extension.CUDAExtension(
            "fe_megatron.ops._C_cuda", ["csrc/cuda/ngram_ops_cuda.cpp", "csrc/cuda/ngram_ops_kernels.cu"],
            extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "--use_fast_math", "-lineinfo"]},
            optional=cuda_mode == "auto"))  # an editable install then does not look for a skipped build's file
    elif cuda_mode == "1":
        raise SystemExit(f"FE_MEGATRON_CUDA=1 asks for the CUDA kernels, but they cannot be built: {problem}")
    else:
        print(f"fe_megatron: CUDA kernels not built ({problem}); the Triton and torch kernels serve GPUs. "
              "FE_MEGATRON_CUDA=1 forces the build.", file=sys.stderr)
    return extensions, {"build_ext": kernel_builder(cpp_extension.BuildExtension, cuda_mode)}


def kernel_builder(build_extension, cuda_mode):
    """torch's BuildExtension, except that under FE_MEGATRON_CUDA=auto a failing CUDA build is
    reported once and skipped instead of failing the whole install."""

    class BuildKernels(build_extension):
        def build_extension(self, ext):
            if cuda_mode != "auto" or not ext.name.endswith("_C_cuda"):
                return super().build_extension(ext)
            try:
                return super().build_extension(ext)
            except Exception as error:  # noqa: BLE001 - any compiler failure means "skip", said once
                print(f"fe_megatron: the CUDA kernels failed to build and are skipped ({error}); "
                      "FE_MEGATRON_CUDA=1 makes this fatal.", file=sys.stderr)

    return BuildKernels


ext_modules, cmdclass = kernel_extensions()

setup(
    name="fe_megatron",
    version="0.1.0",
    description="FactorEngram factorized n-gram memory for Megatron-Core pretraining",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.11",
    packages=find_packages(include=["fe_megatron", "fe_megatron.*"]),
    package_data={"fe_megatron.hf": ["*.jinja"]},  # the plain chat template fe-convert writes into each folder
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    install_requires=[
        "torch>=2.13,<2.16",
        "numpy>=1.24",
        "pyyaml>=6.0",
        "sentencepiece>=0.2",
        "megatron-core>=0.16.1,<0.20",
        "psutil>=5.9",
        "tensorboard>=2.14",
        "matplotlib>=3.7",
        "tqdm>=4.60",
    ],
    extras_require={
        "triton": ["triton>=3.1"],
        "hf": ["transformers>=5.0,<6", "datasets>=2.19", "safetensors>=0.4", "gguf>=0.10", "accelerate>=1.0",
               "lm-eval>=0.4.5"],
        "deepspeed": ["deepspeed>=0.17,<0.20"],
        # pytest 9.2 takes a test's node id from a structured id that pytest-xdist (3.8) cannot suffix with its
        # group, so --dist loadgroup ignores the groups (tests/conftest.py refuses such a run)
        "test": ["pytest>=8,<9.2", "pytest-timeout>=2.3", "pytest-xdist>=3.6", "hypothesis>=6.100",
                 "transformers>=5.0,<6", "safetensors>=0.4",
                 "gguf>=0.10", "accelerate>=1.0", "lm-eval>=0.4.5", "pyarrow>=14",
                 "triton>=3.1", "deepspeed>=0.17,<0.20"],
    },
    entry_points={"console_scripts": [
        "fe-plan=fe_megatron.planning.cli:main",
        "fe-pretrain=fe_megatron.train:main",
        "fe-data=fe_megatron.data.cli:main",
        "fe-demo=fe_megatron.demo:main",
        "fe-convert=fe_megatron.convert.cli:main",
        "fe-eval=fe_megatron.evaluation.cli:main",
        "fe-inspect=fe_megatron.evaluation.inspect:main",
        "fe-megatron-lm-pretrain-gpt=fe_megatron.megatron_lm.pretrain_gpt:main",
        "fe-megatron-lm-pretrain-hybrid=fe_megatron.megatron_lm.pretrain_hybrid:main",
    ],
        # vLLM loads this in each of its processes: `vllm serve <converted folder>` then serves the model
        "vllm.general_plugins": ["fe_megatron=fe_megatron.vllm:register"]},
)
