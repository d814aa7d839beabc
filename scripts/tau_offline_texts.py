"""Why a run's val tau_offline and its eval tau_offline differ: spec.md §6's one count, scored over different texts.

    python scripts/tau_offline_texts.py RUN_DIR --prompts dflash_fast/assets/prompts_eval.jsonl --max-new-tokens 96

RUN_DIR is a finished run (its config.yaml and store; the drafter from RUN_DIR/export unless --drafter). Prints JSON:

    val_trainer        the trainer's validation pass re-run with that drafter: val tau_offline, blocks
    val_documents      eval's offline_tau over the val documents' stored responses (every anchor): tau_offline,
                       blocks, and per document its id, tau_offline, blocks and `seen` (the fraction of its response
                       tokens that end an N-gram found in a training document: near-duplicates of training text)
    val_greedy_equals_stored   val documents whose prompt's greedy continuation of --max-new-tokens equals the
                       stored response's first tokens (the store holds the target's own greedy replies)
    prompts            eval's offline_tau over the target's greedy output for --prompts (`dflash-fast eval`'s
                       tau_offline), with `seen` likewise

The same count on the same documents gives the same number (tests/test_tau_offline_agree.py), so val_trainer near
val_documents and far from prompts says the texts differ, not the counting (docs/training.md). Documents whose
loss mask is not one suffix (multi-turn chats) are skipped and counted. Every training document's N-grams are held
in memory: a diagnostic for small stores (the quickstart's), not for a real run's.
"""
import argparse
import json
import os
import sys
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch
from transformers import AutoTokenizer

from dflash_fast.data.batches import split_documents
from dflash_fast.drafter.model import slot_metrics
from dflash_fast.evaluate.decode import TargetRunner, greedy_generate
from dflash_fast.evaluate.evaluate import load_drafter, offline_tau
from dflash_fast.store.reader import HiddenStateStore
from dflash_fast.target.prompts import encode_prompt, eos_token_ids, load_model, read_prompts
from dflash_fast.train.config import load_config
from dflash_fast.train.data import close_batches, open_batches


def prompt_and_response(store, item: int):
    """A store document -> (prompt ids, response ids), or None when its loss mask is not one suffix."""
    ids, mask = (np.asarray(store[item][k]) for k in ("input_ids", "loss_mask"))
    start = int(mask.astype(bool).argmax())
    if not mask[start:].all() or mask[:start].any():
        return None
    return ids[:start].tolist(), ids[start:].tolist()


def seen_fraction(grams: set, prompt: Sequence[int], response: Sequence[int], n: int) -> float:
    """The fraction of `response`'s tokens that end an n-gram (over prompt + response) found in `grams`."""
    ids = list(prompt) + list(response)
    ends = range(max(len(prompt), n - 1), len(ids))
    return sum(tuple(ids[k - n + 1 : k + 1]) in grams for k in ends) / max(len(ends), 1)


def ratio(pairs: List[Tuple[float, int]]) -> Dict:
    tau_sum, blocks = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
    return {"tau_offline": tau_sum / blocks if blocks else None, "blocks": blocks}


@torch.inference_mode()
def measure(run: str, prompts: str, drafter_path: str = "", target: str = "", max_new_tokens: int = 96,
            num_prompts: int = 0, ngram: int = 9) -> Dict:
    cfg = load_config(os.path.join(run, "config.yaml"))
    target = target or cfg.model.target
    store = HiddenStateStore(cfg.data.store)
    drafter = load_drafter(drafter_path or os.path.join(run, "export"), target).float().eval()
    model = load_model(target, "cpu", "fp32")
    tokenizer = AutoTokenizer.from_pretrained(target)
    eos = eos_token_ids(model.generation_config, tokenizer)
    runner = TargetRunner(model, drafter.config.layer_ids)
    train_docs, val_docs = split_documents(len(store.lengths), cfg.data.val_fraction, cfg.data.split_seed,
                                           store.content)

    loader = open_batches(store, cfg, 0, 1, "val", with_last=True)
    try:
        sums = [slot_metrics(drafter(batch, loss_kind="kl")) for batch in loader]
    finally:
        close_batches(loader)
    val_trainer = ratio([(float(m["tau_sum"]), int(m["blocks"])) for m in sums])

    grams = set()
    for item in train_docs.tolist():
        ids = np.asarray(store[item]["input_ids"]).tolist()
        grams.update(tuple(ids[k : k + ngram]) for k in range(len(ids) - ngram + 1))
    per_doc, skipped, same = [], 0, 0
    for item in sorted(val_docs.tolist()):
        split = prompt_and_response(store, item)
        if split is None:
            skipped += 1
            continue
        prompt, response = split
        tau_sum, blocks = offline_tau(runner, drafter, prompt, response)
        per_doc.append({"document": item, "tau_offline": tau_sum / blocks if blocks else None, "blocks": blocks,
                        "seen": seen_fraction(grams, prompt, response, ngram), "tau_sum": tau_sum})
        greedy = list(greedy_generate(runner, prompt, max_new_tokens, eos)[0])
        same += greedy[: len(response)] == response[: len(greedy)]
    outputs, seen = [], []
    for p in read_prompts(prompts, num_prompts or None):
        ids = encode_prompt(tokenizer, p, None)
        reply = list(greedy_generate(runner, ids, max_new_tokens, eos)[0])
        if len(reply) > 1:
            outputs.append(offline_tau(runner, drafter, ids, reply))
            seen.append(seen_fraction(grams, ids, reply, ngram))
    return {
        "run": run, "ngram": ngram,
        "val_trainer": val_trainer,
        "val_documents": {**ratio([(d.pop("tau_sum"), d["blocks"]) for d in per_doc]), "skipped": skipped,
                          "per_document": per_doc},
        "val_greedy_equals_stored": f"{same}/{len(per_doc)}",
        "prompts": {**ratio(outputs), "prompts": len(outputs), "max_new_tokens": max_new_tokens,
                    "seen": float(np.mean(seen)) if seen else None},
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a finished run's output_dir (config.yaml, its data.store)")
    p.add_argument("--prompts", required=True, help="the prompts `dflash-fast eval --data` read (JSONL)")
    p.add_argument("--drafter", default="", help="an export or checkpoint (default: RUN/export)")
    p.add_argument("--target", default="", help="default: the run's model.target")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--num-prompts", type=int, default=0, help="0: all")
    p.add_argument("--ngram", type=int, default=9, help="N of `seen` (default 9)")
    a = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    result = measure(a.run, a.prompts, a.drafter, a.target, a.max_new_tokens, a.num_prompts, a.ngram)
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
