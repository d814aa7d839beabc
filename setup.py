"""dflash-fast: the fastest correct trainer for DFlash speculative-decoding drafters.

`kernels/` is installed as `dflash_fast.kernels`, never as a top-level `kernels`
package: Hugging Face's `kernels` package has that name and transformers probes
for it.
"""
from setuptools import setup

setup(
    name="dflash-fast",
    version="0.1.0",
    description="Fast, correct DFlash drafter training: extraction, Triton kernels, DeepSpeed trainer",
    python_requires=">=3.10",
    packages=["dflash_fast", "dflash_fast.kernels"],
    package_dir={"dflash_fast": "dflash_fast", "dflash_fast.kernels": "kernels"},
    package_data={"dflash_fast": ["assets/**/*"]},
    include_package_data=True,
    install_requires=[
        "torch",
        "triton",
        "transformers>=5",
        "safetensors",
        "deepspeed",
        "tqdm",
        "accelerate",
        "numpy",
        "pyyaml",
    ],
    extras_require={
        "test": ["pytest", "matplotlib", "tensorboard", "ruff"],
        "plot": ["matplotlib"],
        "gpu": ["flash-attn", "liger-kernel"],
    },
    entry_points={"console_scripts": ["dflash-fast = dflash_fast.cli:main"]},
)
