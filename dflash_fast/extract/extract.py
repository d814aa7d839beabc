"""`dflash-fast extract`: run a frozen Hugging Face target over JSONL data and write a store.

    JSONL ──tokenize──▶ sequences ──plan──▶ shards ──batches──▶ target forward ──▶ store

Per token it keeps the outputs of the tapped decoder layers (`hidden`), the
residual entering the final norm (`last`, captured by a hook on the norm) and
the teacher's next-token summary (top-k ids/logits and the full log-sum-exp)
taken from the logits the forward computes anyway (spec.md §1-2, store_format.py).

Before anything is written, and again every `parity_every` batches, the
extractor recomputes `lm_head(final_norm(last))` with the norm kind it will
record in the manifest and checks it against the model's own logits: a hook on
the wrong tensor or a mis-described norm aborts the run instead of producing a
store that trains a drafter against the wrong teacher. An fp8 store's `last` is
checked once more as training will read it back (dequantised), at fp8's tolerance.

Ranks launched by torchrun or the deepspeed launcher (RANK / WORLD_SIZE /
LOCAL_RANK) take every WORLD_SIZE-th JSONL record, write their own shards,
and leave a note in `ranks/`; rank 0 waits for every note and writes the one
manifest.

The parts live apart: records.py (JSONL -> tokenized documents), plan.py (the job,
validated before the model loads), capture.py (the target forward: taps, `last`,
the parity checks, the teacher summary), store_writer.py (shards, the manifest).
This module runs them: the disk check and `--estimate`, the resumable shard loop,
the rank barrier, the summary, and the command line.
"""
import argparse
import hashlib
import os
import shutil
import sys
import time
from collections import Counter
from dataclasses import fields, replace
from typing import List, Optional, Sequence

import numpy as np

from dflash_fast.errors import COUNT, NUMBER, STR, ListOf, MapOf, Obj, UserError
from dflash_fast.extract.plan import (
    DTYPE_NAMES,
    ExtractOptions,
    Job,
    job_manifest,
    plan_batches,
    plan_job,
    plan_shards,
)
from dflash_fast.extract.runners import make_runner
from dflash_fast.lock import output_lock
from dflash_fast.store.format import (
    DTYPES,
    MANIFEST,
    SHARD_ENTRY,
    SHARDS_DIR,
    read_json,
    read_manifest,
    write_json_atomic,
)
from dflash_fast.store.layer_ids import parse_layer_ids
from dflash_fast.store.reader import HiddenStateStore
from dflash_fast.store.writer import StoreWriter
from dflash_fast.target.records import REASONING_MODES, Example

RANKS_DIR = "ranks"


def _inputs_sha256(examples: Sequence[Example]) -> str:
    h = hashlib.sha256()
    for e in examples:
        h.update(np.int64(len(e.input_ids)).tobytes())
        h.update(e.input_ids.tobytes())
        h.update(e.loss_mask.tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------- disk


class NotEnoughDisk(UserError):
    """The store would not fit on the filesystem of --out."""


def free_bytes(path: str) -> int:
    """Free bytes for an unprivileged writer on the filesystem that holds `path` (or its nearest existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def estimate_disk(job: Job) -> dict:
    """What the store of `job` takes on disk, before anything is written.

    Returns tokens (this rank's), `fields` (name -> dtype, per-token shape, bytes per token, bytes), `total`,
    `per_dtype` (the same store in every store dtype), `remaining` (bytes of this rank's shards not yet complete
    in --out), `needed` (remaining x world_size: ranks take every world_size-th record, so their shares are
    near equal, and they all write to --out's filesystem), `free`.
    """
    lengths = [len(e.input_ids) for e in job.examples]
    tokens = sum(lengths)
    nbytes = job.layout.field_bytes()
    fields = {
        name: {"dtype": str(dtype).replace("torch.", ""), "shape": list(shape), "bytes_per_token": nbytes[name],
               "bytes": nbytes[name] * tokens}
        for name, (_, shape, dtype) in job.layout.fields().items()
    }
    shards_dir = os.path.join(job.out, SHARDS_DIR)
    remaining = sum(
        sum(lengths[i] for i in seqs)
        for s, seqs in enumerate(plan_shards(lengths, job.shard_tokens))
        if not os.path.isdir(os.path.join(shards_dir, StoreWriter.shard_name(job.rank, s)))  # a committed shard
    ) * job.layout.bytes_per_token()
    return {
        "tokens": tokens,
        "fields": fields,
        "total": job.layout.bytes_per_token() * tokens,
        "per_dtype": {d: replace(job.layout, dtype=d).bytes_per_token() * tokens for d in DTYPES},
        "remaining": remaining,
        "needed": remaining * job.world_size,
        "free": free_bytes(job.out),
    }


def check_disk(job: Job, disk: dict) -> None:
    """Refuse to start when --out's filesystem has less free space than the shards still to write."""
    if disk["needed"] > disk["free"]:
        ranks = f" ({job.world_size} ranks x {_size(disk['remaining'])} each)" if job.world_size > 1 else ""
        raise NotEnoughDisk(
            f"{job.out}: the store needs {disk['needed']:,} bytes ({_size(disk['needed'])}){ranks} but its filesystem "
            f"has {disk['free']:,} bytes ({_size(disk['free'])}) free; free space, choose another --out, or a smaller "
            f"--dtype (fp8 is half of bf16); `dflash-fast extract --estimate ...` prints the breakdown"
        )


def _size(nbytes: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def format_estimate(job: Job, disk: dict) -> str:
    """The --estimate report: tokens x bytes per token per field, the total per dtype, free space."""
    lines = [
        f"{job.data}: {job.stats.sequences} sequences, {disk['tokens']:,} tokens "
        f"({job.stats.truncated} truncated to {job.options.max_seq_len}, skipped: {dict(job.stats.skipped) or 'none'})"
        + (f"; rank {job.rank} of {job.world_size}" if job.world_size > 1 else ""),
        f"{'field':<20} {'dtype':<14} {'shape':<12} {'bytes/token':>11} {'total':>12}",
    ]
    for name, f in disk["fields"].items():
        lines.append(f"{name:<20} {f['dtype']:<14} {str(f['shape']):<12} {f['bytes_per_token']:>11,} "
                     f"{_size(f['bytes']):>12}")
    lines.append(f"{'total':<48} {job.layout.bytes_per_token():>11,} {_size(disk['total']):>12}")
    lines.append("in another --dtype: " + ", ".join(
        f"{d} {_size(n)}" for d, n in disk["per_dtype"].items() if d != job.layout.dtype))
    verdict = "enough" if disk["needed"] <= disk["free"] else "NOT ENOUGH: extraction would refuse to start"
    lines.append(f"{job.out}: {_size(disk['needed'])} still to write, {_size(disk['free'])} free ({verdict})")
    return "\n".join(lines)


def estimate(target, data, out, device=None, rank: Optional[int] = None, world_size: Optional[int] = None,
             **options) -> dict:
    """`dflash-fast extract --estimate`: plan the job (tokenize, no model, nothing written), print and return
    the disk it needs (estimate_disk)."""
    job = plan_job(str(target), str(data), str(out), ExtractOptions(**options), device, rank, world_size)
    disk = estimate_disk(job)
    print(format_estimate(job, disk))
    return disk


def extract(target, data, out, device=None, rank: Optional[int] = None, world_size: Optional[int] = None,
            progress: bool = True, **options) -> dict:
    """Extract a store from `target` over `data` (JSONL) into `out`; resume when `out` holds a partial run.

    `options` are ExtractOptions fields. Inputs are validated before the model loads (layer ids against the
    target's config, every JSONL record of this rank). Returns a summary dict (tokens run, bytes written,
    seconds, GB/s, input counts; `num_sequences` and `num_tokens` of the finished store on rank 0).
    """
    job = plan_job(str(target), str(data), str(out), ExtractOptions(**options), device, rank, world_size)
    check_disk(job, estimate_disk(job))  # before anything is written, the lock's directory included
    with output_lock(job.out, job.rank):
        return _extract(job, progress)


def _extract(job: Job, progress: bool) -> dict:
    """extract() of a planned job, holding the lock of its output directory."""
    if _complete_store(job.out, job.id, job.rank):
        run = {"tokens_run": 0, "bytes_written": 0, "seconds": 0.0, "skipped_shards": None}
        return _summarise(job.out, job.rank, job.stats, run, progress)
    runner = make_runner(job)
    manifest = job_manifest(job, runner)
    writer = StoreWriter(job.out, job.layout)
    writer.remove_torn(job.rank)
    note_path = os.path.join(job.out, RANKS_DIR, f"rank{job.rank:05d}.json")
    os.makedirs(os.path.dirname(note_path), exist_ok=True)
    if os.path.exists(note_path):
        os.remove(note_path)
    entries, run = _run_shards(writer, runner, job.examples, job.rank, job.id, job.shard_tokens,
                               job.options.batch_tokens, progress)
    write_json_atomic(note_path, {"job": job.id, "shards": entries, "input": job.stats.to_dict(), "run": run})
    if job.rank == 0:
        notes = _wait_for_ranks(job.out, job.world_size, job.id)
        _finish(writer, manifest, notes)
        # Report the whole job: ranks ran in parallel, so the slowest one sets the time.
        run = {k: sum(n["run"][k] for n in notes) for k in ("tokens_run", "bytes_written", "skipped_shards")}
        run["seconds"] = max(n["run"]["seconds"] for n in notes)
    return _summarise(job.out, job.rank, job.stats, run, progress)


def _run_shards(writer, runner, examples, rank, job_id, shard_tokens, batch_tokens, progress):
    """Extract this rank's shards, keeping complete ones -> (manifest shard entries, run counters)."""
    lengths = [len(e.input_ids) for e in examples]
    bar = _progress_bar(sum(lengths), rank, progress)
    entries, bytes_written, tokens_run, skipped_shards, done = [], 0, 0, 0, 0
    t0 = time.time()
    for s, seqs in enumerate(plan_shards(lengths, shard_tokens)):
        name = writer.shard_name(rank, s)
        shard_examples = [examples[i] for i in seqs]
        shard_lengths = [lengths[i] for i in seqs]
        meta = {"job": job_id, "inputs_sha256": _inputs_sha256(shard_examples)}
        entries.append({
            "name": name,
            "num_sequences": len(seqs),
            "num_tokens": int(sum(shard_lengths)),
            "num_loss_tokens": int(sum(int(e.loss_mask.sum()) for e in shard_examples)),
        })
        if writer.is_complete(name, shard_lengths, meta):
            skipped_shards += 1
            done += len(seqs)
            bar.update(sum(shard_lengths))
            continue
        shard = None
        try:
            for batch in plan_batches(shard_lengths, batch_tokens):
                arrays = runner([shard_examples[i] for i in batch])
                # Opened after the shard's first forward, so a failed first parity check writes nothing.
                shard = shard or writer.open_shard(name, shard_lengths, meta)
                for i, a in zip(batch, arrays):
                    shard.write(i, a)
                done += len(batch)
                bar.update(sum(shard_lengths[i] for i in batch))
                bar.set_postfix(seq=done)
            shard.commit()
        finally:
            if shard is not None:
                shard.close()
        bytes_written += shard.bytes_written
        tokens_run += int(sum(shard_lengths))
    bar.close()
    run = {"tokens_run": tokens_run, "bytes_written": bytes_written, "seconds": time.time() - t0,
           "skipped_shards": skipped_shards}
    return entries, run


def _complete_store(out, job_id, rank) -> bool:
    """True when `out` already holds the finished store of this very job; refuse a different one.

    A manifest of this job over damaged or missing shards no longer tells the
    truth: rank 0 removes it and the run redoes what is missing.
    """
    manifest = read_manifest(out)
    if manifest is None:
        return False
    if manifest.get("extraction", {}).get("job") != job_id:
        raise ValueError(
            f"{out} already holds a complete store from a different extraction (target, data or settings differ); "
            f"use a new --out directory or delete {out}"
        )
    try:
        HiddenStateStore(out)
    except (FileNotFoundError, ValueError) as e:
        print(f"{out}: the finished store is damaged ({e}); redoing what is missing", file=sys.stderr)
        if rank == 0:
            os.remove(os.path.join(out, MANIFEST))
        return False
    return True


def _wait_for_ranks(out, world_size, job_id, poll_s=0.2) -> List[dict]:
    """File barrier: each rank leaves ranks/rankNNNNN.json once its shards are complete."""
    notes, next_report = {}, time.time() + 60
    while True:
        for r in range(world_size):
            path = os.path.join(out, RANKS_DIR, f"rank{r:05d}.json")
            if r not in notes and os.path.exists(path):
                note = read_json(path, "a rank's note", RANK_NOTE)
                if note["job"] == job_id:
                    notes[r] = note
        if len(notes) == world_size:
            return [notes[r] for r in range(world_size)]
        if time.time() > next_report:
            missing = [r for r in range(world_size) if r not in notes]
            print(f"rank 0: waiting for ranks {missing} to finish their shards", file=sys.stderr)
            next_report = time.time() + 60
        time.sleep(poll_s)


# What a rank leaves in ranks/ when its shards are complete (read by rank 0: _wait_for_ranks).
RANK_NOTE = Obj({
    "job": STR,
    "shards": ListOf(Obj({**SHARD_ENTRY.required, "num_loss_tokens": COUNT})),
    "input": Obj({**dict.fromkeys(("lines", "sequences", "bad_lines", "truncated"), COUNT), "skipped": MapOf(COUNT)},
                 optional={"thinking": MapOf(COUNT)}),
    "run": Obj({"tokens_run": COUNT, "bytes_written": COUNT, "seconds": NUMBER}),
})


def _finish(writer: StoreWriter, manifest: dict, notes: List[dict]) -> None:
    """Rank 0: one manifest over every rank's shards, then remove the rank notes."""
    shards = [entry for note in notes for entry in note["shards"]]
    inputs = [note["input"] for note in notes]
    skipped, thinking = Counter(), Counter()
    for i in inputs:
        skipped.update(i["skipped"])
        thinking.update(i.get("thinking", {}))
    counts = {k: sum(i[k] for i in inputs) for k in ("lines", "sequences", "bad_lines", "truncated")}
    if not shards:
        raise ValueError(f"no usable sequences in the data: {counts}, skipped {dict(skipped)}")
    writer.write_manifest({
        **manifest,
        "num_sequences": sum(e["num_sequences"] for e in shards),
        "num_tokens": sum(e["num_tokens"] for e in shards),
        "num_loss_tokens": sum(e["num_loss_tokens"] for e in shards),
        "shards": shards,
        "extraction": {**manifest["extraction"], "input": {**counts, "skipped": dict(sorted(skipped.items()))},
                       # conversations rendered with the target thinking on / off (ChatTokenizer.thinking_of):
                       # validation and eval warn when their prompts use the other setting
                       "thinking": dict(sorted(thinking.items()))},
    })
    shutil.rmtree(os.path.join(writer.path, RANKS_DIR), ignore_errors=True)


def _progress_bar(total_tokens, rank, progress):
    from tqdm import tqdm

    return tqdm(total=total_tokens, unit="tok", unit_scale=True, desc="extract", disable=not progress or rank != 0)


def _summarise(out, rank, stats, run, progress) -> dict:
    """Summary dict of this call (all ranks on rank 0); rank 0 also prints it."""
    seconds = run["seconds"]
    summary = {
        "out": out,
        "rank": rank,
        **run,
        "gb_per_s": run["bytes_written"] / 1e9 / seconds if seconds > 0 else 0.0,
        "tokens_per_s": run["tokens_run"] / seconds if seconds > 0 else 0.0,
        "input": stats.to_dict(),
    }
    m = read_manifest(out) if rank == 0 else None
    if m is None:
        return summary
    summary.update(num_sequences=m["num_sequences"], num_tokens=m["num_tokens"])
    if progress:
        i = m["extraction"]["input"]
        kept = run["skipped_shards"]
        kept = " (already complete: nothing to do)" if kept is None else (
            f", {kept} complete shards kept" if kept else "")
        print(
            f"store {out}: {m['num_sequences']} sequences, {m['num_tokens']} tokens "
            f"({m['num_loss_tokens']} with loss), layer ids {m['layer_ids']}, {m['dtype']}\n"
            f"this run: {run['tokens_run']} tokens, {run['bytes_written'] / 1e9:.3f} GB in {seconds:.1f} s "
            f"({summary['gb_per_s']:.3f} GB/s, {summary['tokens_per_s']:.0f} tok/s){kept}\n"
            f"input: {i['lines']} records, {i['bad_lines']} bad lines skipped, {i['truncated']} truncated "
            f"to {m['extraction']['max_seq_len']} tokens, skipped: {i['skipped'] or 'none'}"
        )
    return summary


# ---------------------------------------------------------------- CLI

# The flags' defaults are ExtractOptions' (the flags are its fields, named the same: options_of).
DEFAULT = ExtractOptions()


def options_of(args) -> dict:
    """The ExtractOptions fields among a command's parsed flags (serve-target's are fewer than extract's)."""
    return {f.name: getattr(args, f.name) for f in fields(ExtractOptions) if hasattr(args, f.name)}


def _layer_ids_arg(text):
    try:
        return parse_layer_ids(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser) -> None:
    p = parser
    add_target_arguments(p)
    p.add_argument("--data", required=True,
                   help="JSONL ({conversations: [...]}, {text: ...} or {input_ids, loss_mask}), or a Hugging Face "
                        "dataset: a save_to_disk directory, a .parquet / .arrow file or a hub id (docs/extraction.md)")
    p.add_argument("--split", default=DEFAULT.split, help="the split of a Hugging Face dataset (default train)")
    p.add_argument("--max-samples", type=int, default=DEFAULT.max_samples,
                   help="read only the first N records / rows")
    p.add_argument("--reasoning", choices=REASONING_MODES, default=DEFAULT.reasoning,
                   help="an assistant turn's reasoning (<think>...</think>, reasoning_content, thinking): train on it "
                        "(default: the target generates it when it serves), mask (in the context without loss) or "
                        "drop (removed; the template's thinking switch off)")
    p.add_argument("--out", required=True, help="store directory (re-run the same command to resume)")
    p.add_argument("--batch-tokens", type=int, default=DEFAULT.batch_tokens,
                   help=f"padded tokens per forward (default {DEFAULT.batch_tokens})")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT.shard_tokens,
                   help="tokens per shard (default: about 1 GiB)")
    p.add_argument("--skip-bad", action="store_true", help="skip and count malformed JSONL lines instead of failing")
    p.add_argument("--estimate", action="store_true",
                   help="print the disk the store needs (tokens x bytes per token per field and dtype) and the free "
                        "space, then exit without loading the model or writing anything")


def add_target_arguments(p) -> None:
    """The flags of the target and of what is captured from it: extract's, and serve-target's (serve_target.py)."""
    p.add_argument("--target", required=True, help="Hugging Face causal LM: local directory or hub id")
    p.add_argument("--layer-ids", type=_layer_ids_arg, default=DEFAULT.layer_ids,
                   help="comma-separated decoder layer ids, 0..L-1 (id l = HF hidden_states[l+1]); "
                        "default: --num-tapped ids spread over 1..L-3")
    p.add_argument("--num-tapped", type=int, default=DEFAULT.num_tapped,
                   help=f"K, when --layer-ids is not given (default {DEFAULT.num_tapped})")
    p.add_argument("--max-seq-len", type=int, default=DEFAULT.max_seq_len,
                   help="longer sequences are truncated and counted")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default=DEFAULT.dtype,
                   help="store dtype of hidden/last; fp8 = e4m3 with an fp32 scale per token and layer (half of bf16)")
    p.add_argument("--topk", type=int, default=DEFAULT.topk,
                   help=f"teacher top-k kept per token (default {DEFAULT.topk})")
    p.add_argument("--no-last", action="store_true", help="do not store `last` (stores for ce / top-k losses only)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the target's own modelling code to run")
    p.add_argument("--parity-every", type=int, default=DEFAULT.parity_every,
                   help=f"check lm_head(norm(last)) == logits on the first batch and every N batches (default "
                        f"{DEFAULT.parity_every})")
    p.add_argument("--engine", choices=["hf", "vllm"], default=DEFAULT.engine,
                   help="what runs the target: hf (transformers, one device) or vllm (its extract_hidden_states "
                        "path; docs/engine-target.md)")
    p.add_argument("--tensor-parallel-size", type=int, default=DEFAULT.tensor_parallel_size,
                   help="--engine vllm: GPUs the target spans")


def run(args) -> int:
    (estimate if args.estimate else extract)(args.target, args.data, args.out, **options_of(args))
    return 0
