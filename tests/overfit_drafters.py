"""Drafters overfitted in-process to the embedded target's greedy replies to a few eval prompts: real acceptance in
seconds, for the tests that serve an export in another engine (tests/test_vllm.py, tests/test_llama_cpp.py)."""
import functools
import os

import torch

from dflash_fast.drafter import ops
from dflash_fast.drafter.model import build_drafter
from dflash_fast.evaluate.decode import TargetRunner, greedy_generate
from dflash_fast.evaluate.evaluate import response_row
from dflash_fast.evaluate.quickstart import ASSETS, TARGET
from dflash_fast.target.prompts import load_model, read_prompts

LAYER_IDS = [1, 3, 5]
B = 4
PROMPTS = os.path.join(ASSETS, "prompts_eval.jsonl")
NUM_PROMPTS, NEW_TOKENS = 3, 32
SLIDING_24 = dict(num_layers=1, layer_types=["sliding"], sliding_window=24, causal_in_block=True)
DRAFTERS = {
    "full": dict(num_layers=1),
    # trained with the window vLLM serves (each slot's own position), and with spec.md §4's (the anchor's)
    "sliding": dict(SLIDING_24, window_from="query"),
    "sliding-anchor": SLIDING_24,
    # served by vLLM's V2 runner only: a sliding layer (causal, the window vLLM serves) under a bidirectional full one,
    # in the z-lab layout (the speculators one has one in-block rule for every layer); DSpark in DSpark's default
    # alignment (B drafts a block), with the vanilla Markov head (the one vLLM builds) and a confidence head
    "mixed": dict(num_layers=2, layer_types=["sliding", "full"], sliding_window=24, window_from="query",
                  causal_in_block=[True, False]),
    "dspark": dict(num_layers=1, sample_from_anchor=True, markov_rank=16, confidence_head=True),
    # DFlash2 (spec.md §9): both additions, served by vLLM's DFlash2DraftModel (qwen3_dflash2.py, the V2 speculator's
    # selector walk)
    "dflash2": dict(num_layers=1, conv_kernel_size=2, conv_group_size=16, selector_rank=16, selector_top_k=8),
    # LiLiCorr (spec.md §11): the lattice on the plain backbone, served by vLLM's LiLiCorrDraftModel (the V2
    # speculator's lattice walk)
    "lilicorr": dict(num_layers=1, lilicorr_candidate_topk=4, lilicorr_hidden_size=32, lilicorr_num_heads=2,
                     lilicorr_factor_dim=8),
}


def eval_prompts(prefix: str = "") -> list:
    """The first NUM_PROMPTS eval prompts as records, each one's first turn after `prefix` (one shared prefix)."""
    records = [p.record for p in read_prompts(PROMPTS, NUM_PROMPTS)]
    return [dict(r, conversations=[dict(r["conversations"][0], content=prefix + r["conversations"][0]["content"]),
                                   *r["conversations"][1:]]) for r in records]


@functools.lru_cache(maxsize=2)
def training_rows(prefix: str = "") -> tuple:
    """The target's greedy replies to the eval prompts (after `prefix`) as training rows, every response position an
    anchor."""
    from transformers import AutoTokenizer

    from dflash_fast.target.prompts import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    runner = TargetRunner(load_model(TARGET, "cpu", "fp32"), LAYER_IDS)
    rows = []
    for prompt in read_prompts(eval_prompts(prefix), None):
        ids = encode_prompt(tokenizer, prompt)
        ids = ids + greedy_generate(runner, ids, NEW_TOKENS)[0]
        anchors = torch.arange(len(ids) - NEW_TOKENS, len(ids) - 1)[None]
        row = response_row(runner.forward(ids), ids, len(ids) - NEW_TOKENS)
        row = {k: v.clone() for k, v in row.items()}  # out of inference mode: training needs autograd on them
        rows.append(dict(row, anchors=anchors, anchor_valid=torch.ones_like(anchors, dtype=torch.bool)))
    return tuple(rows)


@functools.lru_cache(maxsize=None)
def overfit(kind: str, steps: int = 60, prefix: str = "") -> torch.nn.Module:
    """A drafter of `kind` trained (AdamW, eager ops; ce, kl where a confidence head or LiLiCorr's distractor penalty
    needs the teacher) on the target's greedy replies to the eval prompts (each after `prefix`). Trained once per
    process (the vLLM test files run in one and share the full drafter): callers read it, never change it."""
    rows = training_rows(prefix)
    torch.manual_seed(0)
    drafter = build_drafter(TARGET, LAYER_IDS, block_size=B, **DRAFTERS[kind])
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    with ops.backend("eager"):
        for _ in range(steps):
            for row in rows:
                teacher = drafter.proposes_confidence or drafter.config.family == "lilicorr"
                drafter(row, loss_kind="kl" if teacher else "ce").loss.backward()
                opt.step()
                opt.zero_grad()
    return drafter.eval()
