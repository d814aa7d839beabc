"""`dflash-fast export`: a training run's newest verified checkpoint (or one named) written as an export, through the
gate of serve/export.py. It reads a trainer checkpoint (train/checkpoint.py), so it sits with the trainer, above the
export formats it writes.
"""

import argparse

from dflash_fast.serve.engines import (
    ENGINES,
)
from dflash_fast.serve.export import export_drafter
from dflash_fast.serve.layouts import FORMATS
from dflash_fast.store.format import torch_dtype
from dflash_fast.train.checkpoint import load_drafter_for_export


def add_arguments(parser):
    parser.add_argument(
        "--checkpoint", required=True, help="a trainer run directory, its checkpoints/ directory or one checkpoint"
    )
    parser.add_argument("--out", required=True, help="export directory (replaced if it holds an earlier export)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument(
        "--format",
        default="speculators",
        choices=FORMATS,
        help="speculators: vLLM and vllm-project/speculators; zlab: SGLang (and vLLM), z-lab's published layout",
    )


def run(args: argparse.Namespace):
    drafter, verifier = load_drafter_for_export(args.checkpoint)
    export_drafter(drafter, args.out, verifier, torch_dtype(args.dtype), fmt=args.format)
    print(
        f"exported {sum(p.numel() for p in drafter.parameters()):,} parameters to {args.out} ({args.format} format; "
        f"read back as {' and '.join(ENGINES[args.format])} read it: same architecture and logits)"
    )
