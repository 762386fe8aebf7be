"""fe_megatron: FactorEngram memory for Megatron-Core pretraining.

Dependency ranges are chosen so that both torch 2.13 on Python 3.11 (CPU) and the
torch 2.11 GPU image on Python 3.12 satisfy them without reinstalling torch.
"""

from setuptools import find_packages, setup

setup(
    name="fe_megatron",
    version="0.1.0",
    description="FactorEngram factorized n-gram memory for Megatron-Core and DeepSpeed pretraining",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["fe_megatron", "fe_megatron.*"]),
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
        "hf": ["transformers>=4.46", "datasets>=2.19"],
        "deepspeed": ["deepspeed>=0.16"],
        "test": ["pytest>=8", "pytest-timeout>=2.3", "transformers>=4.46", "pyarrow>=14"],
    },
    entry_points={"console_scripts": [
        "fe-plan=fe_megatron.plan:main",
        "fe-pretrain=fe_megatron.train:main",
        "fe-data=fe_megatron.data.cli:main",
        "fe-demo=fe_megatron.demo:main",
    ]},
)
