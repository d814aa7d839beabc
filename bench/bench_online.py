"""Online vs store-backed training steps, side by side: what running the target inside the job costs the drafter.

    python bench/bench_online.py [--model 1.7b|8b] [--steps 5] [--out DIR]     # GPU: a random target of those shapes
    python bench/bench_online.py --smoke                                        # CPU: the embedded target (CI only)

One data set (random-token documents, `{"input_ids", "loss_mask"}` JSONL), one drafter config, one seed; three
Trainers (dflash_fast.train.trainer, the real `train_step`), each timed over `--steps` optimizer steps after one
untimed:

  store               batches from a store extracted from the same JSONL beforehand (in-process loading)
  online (in line)    data.source=online, data.online.prefetch=false: each micro-batch's target forward, then the step
  online (prefetch)   data.source=online: micro-batch s + 1's target forward on a side thread (and CUDA stream)

Columns: step_ms (median), wait_ms (the step waiting for its micro-batches: the loader, or the target forward not
hidden by prefetch), target_forward_ms (the forwards of the step's micro-batches, wherever they ran), drafter_ms
(forward + backward + optimizer), tokens_per_s, ratio_vs_store (store step_ms / this step_ms).
The target (GPU) is a random Qwen3 of `--model`'s shapes saved once to --tmp with the embedded target's tokenizer.
Results: <out>/online.{json,md,png} (online_smoke.* with --smoke). CPU times are never a performance claim.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_extract import MODELS, build_target  # noqa: E402
from bench.harness import write_results  # noqa: E402
from dflash_fast.data.source import Source  # noqa: E402
from dflash_fast.evaluate.quickstart import REPO, TARGET  # noqa: E402
from dflash_fast.extract.extract import extract  # noqa: E402
from dflash_fast.train import trainer  # noqa: E402
from dflash_fast.train.config import load_config  # noqa: E402
from dflash_fast.train.distributed import init_distributed  # noqa: E402

PATHS = ("store", "online (in line)", "online (prefetch)")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="the embedded target on CPU, tiny shapes (CI only)")
    p.add_argument("--model", choices=("1.7b", "8b"), default="1.7b", help="target shapes (GPU run)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps timed per path (after one untimed)")
    p.add_argument("--tmp", default=None, help="where the target, the JSONL and the store go (default: system temp)")
    p.add_argument("--out", default=os.path.join("bench", "results"), help="results folder (default bench/results)")
    return p.parse_args(argv)


def write_documents(path, num_docs, doc_len, vocab, seed=0):
    """Random-token documents, loss on their second half (a prompt, then the reply the drafter learns)."""
    rng = np.random.default_rng(seed)
    mask = [0] * (doc_len // 2) + [1] * (doc_len - doc_len // 2)
    with open(path, "w") as f:
        for _ in range(num_docs):
            f.write(json.dumps({"input_ids": rng.integers(0, vocab, doc_len).tolist(), "loss_mask": mask}) + "\n")


def random_target(name, directory):
    """A random bf16 Qwen3 of `name`'s shapes saved to `directory` with the embedded target's tokenizer."""
    if not os.path.exists(os.path.join(directory, "config.json")):
        model = build_target(MODELS[name], torch.bfloat16, torch.device("cuda"))
        model.save_pretrained(directory)
        del model
        torch.cuda.empty_cache()
        for f in TOKENIZER_FILES:
            shutil.copy(os.path.join(TARGET, f), directory)
    return directory


def time_path(path, overrides, steps):
    """Build a Trainer for one path and time `steps` train_steps after one untimed -> row. train_step synchronises
    the device after every phase, so wall-clock time is the step's time on a GPU too."""
    cfg = load_config(os.path.join(REPO, "configs", "tiny.yaml"), overrides)
    t = trainer.Trainer(cfg, *init_distributed())
    timed = []
    try:
        t.train_step()
        for _ in range(steps):
            t0 = time.perf_counter()
            _, phases, _ = t.train_step()
            timed.append((time.perf_counter() - t0, phases))
    finally:
        t.stream.close()
    mean_ms = lambda key: 1e3 * float(np.mean([p.get(key, 0.0) for _, p in timed]))
    step_ms = sorted(1e3 * s for s, _ in timed)[steps // 2]
    d = cfg.data
    return {
        "path": path,
        "step_ms": step_ms,
        "wait_ms": mean_ms("fetch"),
        "target_forward_ms": mean_ms("target_forward") if Source.of(d).runs_target else None,
        "drafter_ms": mean_ms("drafter"),
        "tokens_per_s": d.seq_len * d.batch_rows * cfg.schedule.grad_accum / (step_ms / 1e3),
    }


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        sizes = {"seq_len": 256, "anchors": 32, "rows": 2, "docs": 24, "doc_len": 200, "layers": 1, "block": 8}
        dtype, precision, steps = "fp32", "fp32", 2
    elif torch.cuda.is_available():
        sizes = {"seq_len": 2048, "anchors": 256, "rows": 1, "docs": 64, "doc_len": 1024, "layers": 5, "block": 16}
        dtype, precision, steps = "bf16", "bf16", args.steps
    else:
        sys.exit("the full benchmark needs a CUDA GPU; run with --smoke on CPU")
    work = tempfile.mkdtemp(prefix="bench-online-", dir=args.tmp)
    try:
        target = TARGET if args.smoke else random_target(args.model, os.path.join(work, "target"))
        vocab = json.load(open(os.path.join(target, "config.json")))["vocab_size"]
        jsonl, store = os.path.join(work, "data.jsonl"), os.path.join(work, "store")
        write_documents(jsonl, sizes["docs"], sizes["doc_len"], vocab)
        extract(target, jsonl, store, dtype=dtype, max_seq_len=sizes["seq_len"], progress=False)
        common = [
            f"model.target={target}", f"model.num_layers={sizes['layers']}", f"model.block_size={sizes['block']}",
            f"data.seq_len={sizes['seq_len']}", f"data.num_anchors={sizes['anchors']}",
            f"data.batch_rows={sizes['rows']}", "data.num_workers=0", "data.val_fraction=0", "validation.every=0",
            "logging.progress=false", "checkpoint.every=0", "export=false", f"precision={precision}",
            "schedule.steps=1000",
        ]
        online = ["data.source=online", f"data.jsonl={jsonl}", f"data.online.dtype={dtype}",
                  f"data.online.max_seq_len={sizes['seq_len']}"]
        overrides = {
            "store": [f"data.store={store}"],
            "online (in line)": online + ["data.online.prefetch=false"],
            "online (prefetch)": online,
        }
        rows = []
        for path in PATHS:
            out_dir = os.path.join(work, "runs", path.replace(" ", "_").strip("()"))
            rows.append(time_path(path, common + overrides[path] + [f"output_dir={out_dir}"], steps))
        for row in rows:
            row["ratio_vs_store"] = rows[0]["step_ms"] / row["step_ms"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    meta = {
        "target": "the embedded target (8 layers, H 128)" if args.smoke else f"random Qwen3 ({args.model})",
        "shape": sizes,
        "dtype": dtype,
        "note": "CPU wall-clock times: a smoke run, never a performance claim" if args.smoke else "GPU",
    }
    name = "online_smoke" if args.smoke else "online"
    print(write_results(name, rows, args.out, plot={"x": "path", "y": "step_ms", "group": "path"}, meta=meta))
    if args.smoke:
        print("CPU times: this smoke run checks that every path runs; it measures nothing")


if __name__ == "__main__":
    main()
