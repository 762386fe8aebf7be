"""fe_megatron: FactorEngram memory for Megatron-Core pretraining.

Dependency ranges are chosen so that both torch 2.13 on Python 3.11 (CPU) and the
torch 2.11 GPU image on Python 3.12 satisfy them without reinstalling torch.

Kernels (install with ``pip install --no-build-isolation -e .`` so the build sees torch):
* ``fe_megatron.ops._C_cpu``: OpenMP C++ kernels, built on every machine for its own
  processor (``-march=native``, as DeepSpeed's CPU ops; ``FE_MEGATRON_CPU_ARCH=x86-64-v2``
  or another ``-march`` value builds for a wider range of machines);
* ``fe_megatron.ops._C_cuda``: CUDA kernels, built where torch has CUDA and nvcc is found
  (``FE_MEGATRON_CUDA_ARCH`` overrides the target list, default ``8.0;9.0``).
Without torch at build time nothing is compiled and ``fe_megatron.ops`` uses its torch reference.
"""

import os

from setuptools import find_packages, setup


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
        "fe_megatron.ops._C_cpu", ["csrc/cpu/ngram_ops_cpu.cpp"],
        # -ffp-contract=off: no fused multiply-add that the torch reference does not do either
        extra_compile_args=["-O3", "-ffp-contract=off", *arch, *openmp], extra_link_args=openmp)]
    if torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", os.environ.get("FE_MEGATRON_CUDA_ARCH", "8.0;9.0"))
        extensions.append(cpp_extension.CUDAExtension(
            "fe_megatron.ops._C_cuda", ["csrc/cuda/ngram_ops_cuda.cpp", "csrc/cuda/ngram_ops_kernels.cu"],
            extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "--use_fast_math", "-lineinfo"]}))
    return extensions, {"build_ext": cpp_extension.BuildExtension}


ext_modules, cmdclass = kernel_extensions()

setup(
    name="fe_megatron",
    version="0.1.0",
    description="FactorEngram factorized n-gram memory for Megatron-Core pretraining",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["fe_megatron", "fe_megatron.*"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    install_requires=[
        "torch>=2.6,<2.14",
        "numpy>=1.24",
        "pyyaml>=6.0",
        "sentencepiece>=0.2",
        "megatron-core>=0.16.1,<0.18",
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
        "test": ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100", "transformers>=5.0,<6", "safetensors>=0.4",
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
    ]},
)
