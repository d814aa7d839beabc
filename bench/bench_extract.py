"""Extraction throughput: dflash_fast.extract.extract's runner and writer vs the target's bare forward, same batches.

    python bench/bench_extract.py [--model 8b|1.7b] [--seq-len 2048] [--batch-tokens 16384] [--batches 3] [--out DIR]
    python bench/bench_extract.py --smoke       # CPU: a tiny fp32 Qwen3 (CI only)

The target is a randomly initialised Qwen3 built in code (no hub): `8b` has Qwen3-8B's
shapes (36 layers, H = 4096, V = 151936), `1.7b` Qwen3-1.7B's; bf16, the attention
extraction picks (FlashAttention-2 when installed, else SDPA). Every batch holds
batch_tokens / seq_len random sequences of seq_len tokens. Paths, each timed per batch
after a warm-up:

  bare forward          model(input_ids, attention_mask, use_cache=False): the logits the teacher needs, nothing kept
  forward + hidden      the same with output_hidden_states=True (what the taps cost on the GPU)
  extract (runner)      capture.TargetRunner: forward, final-norm hook, taps, fp32 top-k and lse over V, copies to host
  extract + write       extract._run_shards: the runner plus StoreWriter shards (pre-sized files, fsync, rename)
                        in a temporary directory, over all batches: tokens/s and bytes/s written

ratio_vs_bare = tokens/s of the path / tokens/s of the bare forward (goal: >= 0.8 for extract + write).
Results: <out>/extract.{json,md,png} (extract_smoke.* with --smoke). CPU times are no claim.
"""
import argparse
import os
import shutil
import sys
import tempfile
import time
import traceback

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import peak_memory_mb, time_calls_ms, write_results  # noqa: E402
from dflash_fast.extract.capture import TargetRunner  # noqa: E402
from dflash_fast.extract.extract import _run_shards  # noqa: E402
from dflash_fast.store.format import Layout  # noqa: E402
from dflash_fast.store.layer_ids import default_layer_ids  # noqa: E402
from dflash_fast.store.writer import StoreWriter  # noqa: E402
from dflash_fast.target.load import attention_implementation  # noqa: E402
from dflash_fast.target.records import Example  # noqa: E402

MODELS = {
    "8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False),
    "1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=6144, vocab_size=151936, tie_word_embeddings=True),
    "smoke": dict(hidden_size=32, num_hidden_layers=8, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                  intermediate_size=64, vocab_size=256, tie_word_embeddings=False),
}
TOPK = 8
NUM_TAPPED = 5


def build_target(sizes, dtype, device):
    """A random Qwen3ForCausalLM with `sizes`, in eval mode on `device`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        **sizes, max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1e6}
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM._from_config(config, dtype=dtype, attn_implementation=attention_implementation(device))
    return model.eval()


def make_examples(n, seq_len, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [Example(rng.integers(0, vocab, seq_len, dtype=np.int32), np.ones(seq_len, dtype=bool)) for _ in range(n)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny fp32 target on CPU (CI only)")
    p.add_argument("--model", choices=("8b", "1.7b"), default="8b", help="target shapes (GPU run)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-tokens", type=int, default=16384, help="tokens per forward, as `extract --batch-tokens`")
    p.add_argument("--batches", type=int, default=3, help="batches timed per path")
    p.add_argument("--tmp", default=None, help="where the store is written (default: the system temp dir)")
    p.add_argument("--out", default=os.path.join("bench", "results"), help="results folder (default bench/results)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        device, dtype, store_dtype, name = torch.device("cpu"), torch.float32, "float32", "smoke"
        args.seq_len, args.batch_tokens, args.batches = 32, 64, 2
    elif torch.cuda.is_available():
        device, dtype, store_dtype, name = torch.device("cuda"), torch.bfloat16, "bfloat16", args.model
    else:
        sys.exit("the full benchmark needs a CUDA GPU; run with --smoke on CPU")
    sizes = MODELS[name]
    per_batch = max(1, args.batch_tokens // args.seq_len)
    batch_tokens = per_batch * args.seq_len
    model = build_target(sizes, dtype, device)
    layer_ids = default_layer_ids(sizes["num_hidden_layers"], NUM_TAPPED)
    layout = Layout(len(layer_ids), sizes["hidden_size"], TOPK, store_dtype, True)
    examples = make_examples(per_batch * args.batches, args.seq_len, sizes["vocab_size"])
    batch = examples[:per_batch]
    ids = torch.from_numpy(np.stack([e.input_ids for e in batch])).long().to(device)
    mask = torch.ones_like(ids)
    reps = dict(warmup=1, rep=args.batches)

    def forward(hidden_states):
        with torch.inference_mode():
            return model(input_ids=ids, attention_mask=mask, use_cache=False, output_hidden_states=hidden_states).logits

    # parity_every=10**9: the first call (the warm-up) checks lm_head(norm(last)) == logits, as extraction does.
    runner = TargetRunner(model, layer_ids, layout, pad_id=0, parity_every=10**9)
    paths = {
        "bare forward": lambda: forward(False),
        "forward + hidden": lambda: forward(True),
        "extract (runner)": lambda: runner(batch),
    }
    meta = {
        "target": f"random Qwen3 ({name}): " + ", ".join(f"{k}={v}" for k, v in sizes.items()),
        "layer_ids": layer_ids,
        "store": f"{store_dtype}, with last, top-{TOPK}, {layout.bytes_per_token()} bytes per token",
        "attention": attention_implementation(device),
    }
    out_name = "extract_smoke" if args.smoke else "extract"
    rows = []
    base = {
        "model": name,
        "seq_len": args.seq_len,
        "batch_tokens": batch_tokens,
        "dtype": str(dtype).replace("torch.", ""),
    }
    for path, fn in paths.items():
        row = {"path": path, **base}
        try:
            ms = sorted(time_calls_ms(fn, **reps))[args.batches // 2]
            row.update(
                ms_per_batch=ms, tokens_per_s=batch_tokens / (ms / 1e3), peak_gb=_gb(peak_memory_mb(fn, resident=True))
            )
        except Exception as err:  # noqa: BLE001 -- a failure is a result: record it, time the other paths
            traceback.print_exc()
            row["note"] = f"failed: {type(err).__name__}: {err}"
        rows.append(row)
        flush(out_name, rows, args.out, meta)
    rows.append(write_path(runner, examples, layout, per_batch, batch_tokens, args.tmp, base))
    print(flush(out_name, rows, args.out, meta))


def flush(name, rows, out, meta):
    """Ratios to the bare forward, then the results so far (a run stopped by a timeout keeps them)."""
    bare = rows[0].get("tokens_per_s")
    for row in rows:
        if bare and row.get("tokens_per_s"):
            row["ratio_vs_bare"] = row["tokens_per_s"] / bare
    return write_results(name, rows, out, plot={"x": "path", "y": "tokens_per_s", "group": "model"}, meta=meta)


def write_path(runner, examples, layout, per_batch, batch_tokens, tmp, base):
    """extract._run_shards over every example into a temporary store: tokens/s and bytes/s."""
    row = {"path": "extract + write", **base}
    out = tempfile.mkdtemp(prefix="bench-extract-", dir=tmp)
    try:
        writer = StoreWriter(out, layout)
        shard_tokens = max(1, (1 << 30) // layout.bytes_per_token())  # extract's default: about 1 GiB a shard
        t0 = time.perf_counter()
        _, run = _run_shards(writer, runner, examples, 0, "bench", shard_tokens, batch_tokens, progress=False)
        seconds = time.perf_counter() - t0
        row.update(
            ms_per_batch=seconds * 1e3 * per_batch / len(examples),
            tokens_per_s=run["tokens_run"] / seconds,
            gb_per_s=run["bytes_written"] / seconds / 1e9,
            bytes_written=run["bytes_written"],
            bytes_per_token=run["bytes_written"] / run["tokens_run"],
        )
    except Exception as err:  # noqa: BLE001
        traceback.print_exc()
        row["note"] = f"failed: {type(err).__name__}: {err}"
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return row


def _gb(mb):
    return None if mb is None else mb / 1024


if __name__ == "__main__":
    main()
