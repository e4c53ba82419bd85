"""megagate: Megatron-Core training system for gated-attention LLMs."""

from setuptools import find_packages, setup

setup(
    name="megagate",
    version="0.1.0",
    description="Gated-attention transformers (dense and MoE) on megatron-core",
    packages=find_packages(include=["megagate", "megagate.*"]),
    package_data={"megagate": ["presets/*.yaml", "configs/*.yaml"]},
    python_requires=">=3.12",
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.19,<0.20",
        "numpy",
        "packaging",
        "PyYAML",
        "einops",
    ],
    extras_require={
        # Transformer Engine needs a CUDA toolchain; BF16/FP8 TE modules are used when it imports.
        "te": ["transformer-engine[pytorch]>=2.6"],
        "dali": ["nvidia-dali-cuda120>=1.40"],
        "data": ["tokenizers>=0.20", "tiktoken>=0.8"],
        "monitor": ["tensorboard>=2.16", "matplotlib>=3.8"],
        "dev": ["pytest>=8", "pytest-timeout>=2.3"],
    },
    entry_points={"console_scripts": ["megagate=megagate.cli:main"]},
)
