"""vLLM in the loop: the real engine serves our exports and must agree with our evaluator and our model of it.

Runs where vLLM is installed (.ci/run's second venv, docs/vllm.md); DFLASH_REQUIRE_VLLM=1 turns the skip into a
failure there. Drafters are overfitted in-process to the embedded target's greedy replies to a few prompts (real
acceptance in seconds), exported, and served by vLLM on its V1 CPU runner (full-attention and all-sliding drafters;
mixed ones get the config read-back check only: the V1 runner refuses them).
"""
import dataclasses
import json
import os

import pytest
import torch

if os.environ.get("DFLASH_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from dflash_fast import ops  # noqa: E402 (vLLM's absence skips the module first)
from dflash_fast.drafter import DFlashDrafter, build_drafter  # noqa: E402
from dflash_fast.engines import architecture, served_architectures  # noqa: E402
from dflash_fast.evaluate import TargetRunner, evaluate, greedy_generate, response_row  # noqa: E402
from dflash_fast.export import export_drafter, read_export_config  # noqa: E402
from dflash_fast.quickstart import ASSETS, TARGET  # noqa: E402
from dflash_fast.regenerate import load_model, read_prompts, regenerate  # noqa: E402
from dflash_fast.vllm_engine import evaluate_vllm, vllm_architecture  # noqa: E402

LAYER_IDS = [1, 3, 5]
B = 4
PROMPTS = os.path.join(ASSETS, "prompts_eval.jsonl")
NUM_PROMPTS, NEW_TOKENS = 3, 32
# vLLM's CPU kernels and our eager ops round differently; a near-tie in the drafter's top choice then drafts another
# token at one step, and the replies drift by a block from there. Totals agree within this; outputs exactly.
TAU_TOLERANCE = 0.1
DRAFTERS = {
    "full": dict(num_layers=1),
    "sliding": dict(num_layers=1, layer_types=["sliding"], sliding_window=24, causal_in_block=True),
}


def overfit(kind: str, steps: int = 60) -> torch.nn.Module:
    """A drafter of `kind` trained (ce, AdamW, eager ops) on the target's greedy replies to the eval prompts."""
    from transformers import AutoTokenizer

    from dflash_fast.regenerate import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    runner = TargetRunner(load_model(TARGET, "cpu", "fp32"), LAYER_IDS)
    rows = []
    for prompt in read_prompts(PROMPTS, NUM_PROMPTS):
        ids = encode_prompt(tokenizer, prompt)
        ids = ids + greedy_generate(runner, ids, NEW_TOKENS)[0]
        anchors = torch.arange(len(ids) - NEW_TOKENS, len(ids) - 1)[None]
        row = response_row(runner.forward(ids), ids, len(ids) - NEW_TOKENS)
        row = {k: v.clone() for k, v in row.items()}  # out of inference mode: training needs autograd on them
        rows.append(dict(row, anchors=anchors, anchor_valid=torch.ones_like(anchors, dtype=torch.bool)))
    torch.manual_seed(0)
    drafter = build_drafter(TARGET, LAYER_IDS, block_size=B, **DRAFTERS[kind])
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    with ops.backend("eager"):
        for _ in range(steps):
            for row in rows:
                drafter(row, loss_kind="ce").loss.backward()
                opt.step()
                opt.zero_grad()
    return drafter.eval()


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{name: export directory}: the full drafter in both layouts, the sliding one in the speculators layout."""
    root = tmp_path_factory.mktemp("vllm_exports")
    full, sliding = overfit("full"), overfit("sliding")
    return {
        "speculators": export_drafter(full, str(root / "speculators"), TARGET, torch.float32, fmt="speculators"),
        "zlab": export_drafter(full, str(root / "zlab"), TARGET, torch.float32, fmt="zlab"),
        "sliding": export_drafter(sliding, str(root / "sliding"), TARGET, torch.float32, fmt="speculators"),
    }


@pytest.fixture(scope="module")
def ours(exports):
    """Our evaluator's report (HF target, real speculative decoding) per export."""
    return {name: evaluate(TARGET, PROMPTS, path, max_new_tokens=NEW_TOKENS, num_prompts=NUM_PROMPTS, offline=False,
                           progress=False) for name, path in exports.items()}


def diagnosis(export_dir: str, hf: dict, served: dict) -> str:
    """Why the engines disagree: the export (vLLM builds another drafter than the trained one) or the evaluator."""
    built, trained = vllm_architecture(export_dir), served_architectures(read_export_config(export_dir))["vllm"]
    fields = [f"{k}: vLLM builds {built[k]!r}, trained {trained[k]!r}" for k in built if built[k] != trained[k]]
    where = ("an error in the export: " + "; ".join(fields)) if fields else (
        "vLLM builds the trained architecture, so the evaluator (ours or vLLM's kernels) differs")
    per_prompt = [(a["tau"], b["tau"]) for a, b in zip(hf["per_prompt"], served["per_prompt"])]
    return f"{where}; per-prompt tau (ours, vLLM): {per_prompt}"


# Found by this test (2026-12-01): vLLM serves the all-sliding drafter with the same greedy output but less
# acceptance (tau 2.879 against our 3.097 on these prompts, config read back identical). Likely cause, not yet fixed:
# SPEC §4 gives every slot of a block the context a-W..a-1, a standard sliding window is relative to each query's own
# position a+j. Strict: the test fails as soon as the two agree, and then the mark goes.
SLIDING_WINDOW_GAP = pytest.mark.xfail(strict=True, reason="vLLM's sliding window is per query position, ours per "
                                       "anchor (SPEC §4): see docs/vllm.md")


@pytest.mark.parametrize("name", ["speculators", "zlab", pytest.param("sliding", marks=SLIDING_WINDOW_GAP)])
def test_vllm_serves_a_trained_export_with_our_evaluators_acceptance_and_greedy_output(exports, ours, name):
    hf = ours[name]
    served = evaluate_vllm(TARGET, PROMPTS, exports[name], max_new_tokens=NEW_TOKENS, num_prompts=NUM_PROMPTS,
                           baseline=name == "speculators")
    assert hf["greedy_mismatches"] == 0 and hf["tau"] > 1.5, f"the overfitted drafter drafts too little: {hf['tau']}"
    assert [p["tokens"] for p in served["per_prompt"]] == [p["tokens"] for p in hf["per_prompt"]], (
        "vLLM's speculative output differs from the target's greedy output: " + diagnosis(exports[name], hf, served))
    if name == "speculators":
        assert served["greedy_mismatches"] == 0, "vLLM's output with the drafter differs from its output without"
    assert abs(served["tau"] - hf["tau"]) <= TAU_TOLERANCE, (
        f"vLLM accepts {served['tau']:.3f} tokens per step, our evaluator {hf['tau']:.3f} (tolerance "
        f"{TAU_TOLERANCE}): " + diagnosis(exports[name], hf, served))
    assert sum(served["acceptance_histogram"]) == served["verify_forwards"] > 0


SLIDING = dict(num_layers=2, layer_types=["sliding", "sliding"], sliding_window=24)
# Every drafter kind in each layout export.py lets it take (a z-lab export must also serve in SGLang: causal sliding
# and bidirectional full layers, all channels rotated); the mixed one is served by vLLM's V2 runner only (a GPU's).
READ_BACK = {
    "full": (dict(num_layers=2), ["speculators", "zlab"]),
    "sliding": (SLIDING, ["speculators"]),
    "sliding-causal": (dict(SLIDING, causal_in_block=True), ["speculators", "zlab"]),
    "mixed": (dict(SLIDING, layer_types=["sliding", "full"], causal_in_block=[True, False]), ["zlab"]),
    "partial-rope": (dict(num_layers=1), ["speculators"]),
}
PARTIAL_ROPE = {"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5}


@pytest.mark.parametrize("kind,fmt", [(k, f) for k, (_, formats) in READ_BACK.items() for f in formats])
def test_vllms_own_config_loader_reads_our_export_as_our_model_of_it_says(tmp_path, kind, fmt):
    drafter = build_drafter(TARGET, LAYER_IDS, block_size=B, **READ_BACK[kind][0])
    if kind == "partial-rope":
        drafter = DFlashDrafter(dataclasses.replace(drafter.config, rope_parameters=PARTIAL_ROPE))
    out = export_drafter(drafter, str(tmp_path / "export"), TARGET, torch.float32, fmt=fmt)
    ours = served_architectures(read_export_config(out))["vllm"]
    assert vllm_architecture(out) == ours == architecture(drafter.config)


def test_regenerate_through_vllm_writes_what_hf_writes_in_greedy_mode(tmp_path):
    kwargs = dict(batch_size=2, max_new_tokens=16, num_prompts=3, progress=False)
    regenerate(TARGET, PROMPTS, str(tmp_path / "hf.jsonl"), **kwargs)
    summary = regenerate(TARGET, PROMPTS, str(tmp_path / "vllm.jsonl"), engine="vllm", **kwargs)
    assert summary["written"] == 3

    def records(path):
        rows = [json.loads(line) for line in open(path)]
        for r in rows:
            assert r.pop("sampling") == dict(engine=path.stem, temperature=0.0, top_p=1.0, top_k=0, seed=0,
                                             max_new_tokens=16)
        return rows

    assert records(tmp_path / "vllm.jsonl") == records(tmp_path / "hf.jsonl")
