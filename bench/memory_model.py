"""The memory model (dflash_fast/train/memory.py) of the Qwen3-8B drafter at long context, computed on a CPU.

    python bench/memory_model.py                      # configs/qwen3-8b.yaml, T = 3k..128k, A = 512/1024/2048
    python bench/memory_model.py --world-size 1 --rows 1 --config configs/qwen3-8b.yaml

Nothing here is a measurement: every number is `dflash_fast.train.memory.step_memory` of the drafter the config builds
for Qwen3-8B (its config.json sizes: bench/bench_extract.py MODELS["8b"]), with the config's ZeRO stage (its
DeepSpeed JSON), optimizer, precision and loss kind, per rank of `--world-size` ranks, one micro-batch of
`--rows` rows. The same function plans `train.py --plan` and refuses a run that does not fit its GPU. The model is
checked against what a CPU step allocates in tests/test_memory.py.

Results: <out>/memory_model_<world size>rank.{json,md}. Tables: the peak per rank at each T and A (with and
without activation checkpointing, and with the target online), its terms at A = 512, the training states per
ZeRO stage, optimizer and world size, and the loss kernel's workspace against bench/lm_head_model.py's modelled
peak (its results JSON, when it has been run).
"""
import argparse
import dataclasses
import glob
import json
import os
import sys
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflash_fast.kernels.lm_head_loss import chunk_plan  # noqa: E402

from bench.bench_extract import MODELS, TOPK  # noqa: E402
from bench.harness import markdown_table, write_results  # noqa: E402
from bench.lm_head_model import REFERENCE, training_rows  # noqa: E402
from dflash_fast.drafter.eager import needs_last  # noqa: E402
from dflash_fast.store.format import Layout  # noqa: E402
from dflash_fast.store.layer_ids import default_layer_ids  # noqa: E402
from dflash_fast.train.config import load_config  # noqa: E402
from dflash_fast.train.memory import (  # noqa: E402
    GIB,
    OnlineTarget,
    Setup,
    Step,
    loss_chunk,
    loss_kernel_bytes,
    run_setup,
    step_memory,
    training_states,
)
from dflash_fast.train.optim import deepspeed_config  # noqa: E402

SEQ_LENS = (3072, 8192, 32768, 131072)
ANCHORS = (512, 1024, 2048)
H200_BYTES = 141 * 10**9  # "141 GB" of HBM3e
RESERVE = 2 * GIB  # CUDA context, allocator slack, NCCL: what the model does not count


def qwen3_8b_drafter(cfg):
    """The drafter `cfg` builds on Qwen3-8B: sizes from its config.json, the default layer ids, the config's
    model.* options."""
    from transformers import Qwen3Config

    from dflash_fast.drafter.config import DrafterConfig

    target = Qwen3Config(**MODELS["8b"])
    ids = cfg.model.layer_ids or default_layer_ids(target.num_hidden_layers)
    return DrafterConfig.from_target(target, ids, target.vocab_size - 1, **cfg.model.drafter_options())


def target_weight_bytes(sizes: Dict, e: int) -> int:
    """Qwen3's parameter count from its config.json sizes, in bytes of dtype size e."""
    h, i, v, d = sizes["hidden_size"], sizes["intermediate_size"], sizes["vocab_size"], sizes["head_dim"]
    q, kv = sizes["num_attention_heads"] * d, sizes["num_key_value_heads"] * d
    layer = h * (2 * q + 2 * kv) + 3 * h * i + 2 * h + 2 * d
    heads = v * h * (1 if sizes["tie_word_embeddings"] else 2)
    return e * (sizes["num_hidden_layers"] * layer + heads + h)


def lm_head_model_peak() -> List[Dict]:
    """bench/lm_head_model.py's modelled loss peaks (`peak_extra_bytes`, kl) from its newest results JSON."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    paths = sorted(p for p in glob.glob(os.path.join(here, "lm_head_model_*.json")) if "kernels" not in p
                   and "small" not in p)
    if not paths:
        return []
    with open(paths[-1]) as f:
        rows = json.load(f)["rows"]
    return [dict(source=os.path.basename(paths[-1]), N=r["N"], peak=r["peak_extra_gb"] * 1e9) for r in rows
            if r["case"] == "kl"]


def sampled_teacher_rows(drafter, n: int, setup: Setup) -> int:
    """The most distinct teacher rows of a chunk of the loss kernel (kernels/lm_head_loss.py chunk_plan) over the
    n block rows of bench/lm_head_model.py's sampled batch at its reference shape."""
    rows = n // (REFERENCE["A"] * REFERENCE["B"])
    _, index = training_rows(REFERENCE, rows)
    chunk, _ = loss_chunk(drafter, n, rows * REFERENCE["T"], setup)
    return max(len(c.teacher_rows) for c in chunk_plan(n, chunk, index, rows * REFERENCE["T"]))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=os.path.join("configs", "qwen3-8b.yaml"))
    p.add_argument("--world-size", type=int, default=8, help="ranks sharing ZeRO's states (default 8: one node)")
    p.add_argument("--rows", type=int, default=1, help="rows per micro-batch (data.batch_rows; default 1)")
    p.add_argument("--out", default=os.path.join("bench", "results"), help="results folder (default bench/results)")
    return p.parse_args(argv)


def main(argv=None) -> List[Dict]:
    args = parse_args(argv)
    cfg = load_config(args.config)
    drafter = qwen3_8b_drafter(cfg)
    precision = "bf16" if cfg.precision == "auto" else cfg.precision  # the GPU's choice
    e = 4 if precision == "fp32" else 2
    ds = deepspeed_config(cfg.deepspeed, cfg, precision)
    dense = needs_last(cfg.loss.kind if cfg.loss.kind != "auto" else "kl", stored_labels=True)
    store = Layout(drafter.num_tapped, drafter.target_hidden_size, TOPK, "bfloat16", has_last=True)
    base = run_setup(cfg, ds, args.world_size, e, dense, store)
    online = OnlineTarget(target_weight_bytes(MODELS["8b"], e), MODELS["8b"]["num_hidden_layers"],
                          MODELS["8b"]["hidden_size"], MODELS["8b"]["intermediate_size"], MODELS["8b"]["vocab_size"], 0,
                          drafter.num_tapped)
    rows = []
    for t in SEQ_LENS:
        for a in ANCHORS:
            step = Step(t, a, args.rows)
            plan = step_memory(drafter, step, base)
            checkpointed = step_memory(drafter, step, dataclasses.replace(base, checkpointing=True)).peak
            online_t = dataclasses.replace(online, forward_tokens=t)
            with_target = step_memory(drafter, step, dataclasses.replace(base, online=online_t)).peak
            fits = lambda b: "yes" if b + RESERVE <= H200_BYTES else "no"  # noqa: E731
            rows.append(dict(T=t, A=a, peak_gib=round(plan.peak / GIB, 1), fits_h200=fits(plan.peak),
                             checkpointed_gib=round(checkpointed / GIB, 1), fits_checkpointed=fits(checkpointed),
                             online_gib=round(with_target / GIB, 1), fits_online=fits(with_target)))
    terms = []
    for t in SEQ_LENS:
        plan = step_memory(drafter, Step(t, 512, args.rows), base)
        terms.append(dict(T=t, **{k: round(v / GIB, 2) for k, v in {**plan.resident, **plan.transient}.items()}))
    states = []
    for optimizer in ("adamw", "muon"):
        for world in (1, 8):
            for stage in (0, 1, 2, 3):
                s = training_states(drafter, Setup(dtype_bytes=e, zero_stage=stage, world_size=world,
                                                   optimizer=optimizer))
                states.append(dict(optimizer=optimizer, world_size=world, zero_stage=stage,
                                   **{k: round(v / GIB, 2) for k, v in s.items()}))
    loss = []
    for r in lm_head_model_peak():
        tokens = r["N"] // (REFERENCE["A"] * REFERENCE["B"]) * REFERENCE["T"]
        loss.append(dict(**r, teacher_rows=sampled_teacher_rows(drafter, r["N"], base),
                         bound=loss_kernel_bytes(drafter, r["N"], tokens, base)))
        loss[-1]["sampled"] = loss_kernel_bytes(drafter, r["N"], tokens, base, loss[-1]["teacher_rows"])
    meta = dict(
        config=f"{args.config}: {drafter.num_layers} drafter layers, block {drafter.block_size}, "
               f"{cfg.optimizer.kind}, ZeRO-{base.zero_stage}, {cfg.precision}, loss {cfg.loss.kind}",
        target="Qwen3-8B (bench/bench_extract.py MODELS['8b']): H = 4096, 36 layers, V = 151936",
        per_rank=f"{args.world_size} ranks, {args.rows} row(s) per micro-batch",
        fits=f"peak + {RESERVE / GIB:.0f} GiB reserve <= 141 GB (one H200)",
        what="a model (dflash_fast/train/memory.py), not a measurement",
    )
    name = f"memory_model_{args.world_size}rank"
    md = write_results(name, rows, args.out, meta=meta)
    md += "\n### terms at A = 512 (GiB)\n\n" + markdown_table(terms)
    md += "\n### training states per rank (GiB)\n\n" + markdown_table(states)
    if loss:
        md += ("\n### loss kernel workspace: ours (teacher rows at their bound, and at the most distinct teacher rows "
               "of a chunk of bench/lm_head_model.py's sampled batch) vs bench/lm_head_model.py's modelled peak\n\n")
        md += markdown_table([dict(r, bound_gib=round(r.pop("bound") / GIB, 2),
                                   sampled_gib=round(r.pop("sampled") / GIB, 2), peak_gib=round(r.pop("peak") / GIB, 2))
                              for r in loss])
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(md)
    print(md)
    return rows


if __name__ == "__main__":
    main()
