"""`dflash-fast export`: a training run's newest verified checkpoint (or one named) written as an export, through the
gate of serve/export.py. It reads a trainer checkpoint (train/checkpoint.py), so it sits with the trainer, above the
export formats it writes.
"""

import argparse

from dflash_fast.serve.engines import serving_engines
from dflash_fast.serve.export import export_run
from dflash_fast.serve.layouts import FORMATS, ExportError
from dflash_fast.serve.model_card import read_eval_report
from dflash_fast.store.format import torch_dtype
from dflash_fast.train.checkpoint import load_checkpoint_for_export


def add_arguments(parser):
    parser.add_argument(
        "--checkpoint", required=True, help="a trainer run directory, its checkpoints/ directory or one checkpoint"
    )
    parser.add_argument("--out", required=True, help="export directory (replaced if it holds an earlier export)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument(
        "--format",
        default="speculators",
        choices=(*FORMATS, "gguf"),
        help="speculators: vLLM and vllm-project/speculators; zlab: SGLang (and vLLM), z-lab's published layout; "
        "gguf: llama.cpp (--out is the .gguf file; docs/llama-cpp.md)",
    )
    parser.add_argument("--card-from", default=None, metavar="EVAL_JSON",
                        help="an eval report (dflash-fast eval --out): its numbers go into the model card, README.md")


def run(args: argparse.Namespace):
    if args.format == "gguf":
        return _run_gguf(args)
    report = read_eval_report(args.card_from) if args.card_from else None  # a bad report fails before any work
    drafter, verifier, client, run_dir = load_checkpoint_for_export(args.checkpoint)
    export_run(drafter, args.out, verifier, torch_dtype(args.dtype), args.format, run_dir, client, report)
    engines = " and ".join(serving_engines(args.format, drafter.config.family))
    print(
        f"exported {sum(p.numel() for p in drafter.parameters()):,} parameters to {args.out} ({args.format} format; "
        f"read back as {engines} read it: same architecture and logits)"
    )


def _run_gguf(args: argparse.Namespace):
    """llama.cpp: the zlab export (a DSpark drafter's speculators export) converted by the vendored
    convert_hf_to_gguf.py (serve/llama_cpp.py's gate)."""
    from dflash_fast.serve.llama_cpp import GGUF_TYPES, export_gguf, local_target

    if args.card_from:
        raise ExportError("--card-from: a GGUF has no model card; give it with --format speculators or zlab")
    if not args.out.endswith(".gguf"):
        raise ExportError(f"--out {args.out}: with --format gguf, --out is the GGUF file to write (e.g. draft.gguf)")
    drafter, verifier, _, _ = load_checkpoint_for_export(args.checkpoint)
    export_gguf(drafter, args.out, local_target(verifier), GGUF_TYPES[args.dtype])
    print(f"exported {sum(p.numel() for p in drafter.parameters()):,} parameters to {args.out} (GGUF, "
          f"{GGUF_TYPES[args.dtype]}; read back as llama.cpp reads it: same architecture, taps and tensors)")
