"""llama.cpp (docs/llama-cpp.md): the GGUF gate reads a drafter as llama.cpp reads it and refuses, naming the field,
one llama.cpp would serve differently; and llama.cpp itself (the tree llama-cpp-python 0.3.36 vendors, built by
scripts/build_llama_cpp.sh) serves our trained export with the target's own greedy output and our acceptance.

The gate tests write GGUFs with the `gguf` package, with the keys the vendored convert_hf_to_gguf.py writes for the
overfitted test drafter (read off a real conversion); the served tests run where the tools are built (the cache of
scripts/build_llama_cpp.sh) and build them when DFLASH_REQUIRE_LLAMA_CPP=1 (a missing build is then a failure).
"""
import json
import os

import pytest
import torch
from overfit_drafters import DRAFTERS, LAYER_IDS, NEW_TOKENS, NUM_PROMPTS, PROMPTS, B, overfit

from dflash_fast.drafter.model import build_drafter
from dflash_fast.evaluate.evaluate import evaluate
from dflash_fast.evaluate.llama_cpp import evaluate_llama_cpp
from dflash_fast.evaluate.quickstart import TARGET
from dflash_fast.serve import llama_cpp
from dflash_fast.serve.engines import architecture
from dflash_fast.serve.layouts import ExportError
from dflash_fast.target.prompts import encode_prompt, read_prompts

gguf = pytest.importorskip("gguf")  # a test extra (setup.py): never absent in CI

# What the vendored converter writes for the overfitted "full" drafter (B = 4, layer ids [1, 3, 5], the embedded
# target's 128-wide Qwen3 with 2048 tokens), read back from a real conversion on 2026-12-07.
CONVERTED = {
    "dflash.block_count": 1, "dflash.context_length": 2048, "dflash.embedding_length": 128,
    "dflash.feed_forward_length": 384, "dflash.attention.head_count": 4, "dflash.attention.head_count_kv": 2,
    "dflash.attention.causal": False, "dflash.rope.freq_base": 10000.0,
    "dflash.attention.layer_norm_rms_epsilon": 1e-6, "dflash.attention.key_length": 32,
    "dflash.attention.value_length": 32, "dflash.block_size": 4, "dflash.target_layers": [2, 4, 6],
    "tokenizer.ggml.mask_token_id": 3,
}


def write_gguf(path: str, fields: dict, tensors: dict = ()) -> str:
    writer = gguf.GGUFWriter(path, "dflash")
    for key, value in fields.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, list) and value and isinstance(value[0], bool):
            writer.add_array(key, value)
        else:
            writer.add_array(key, [int(v) for v in value])
    writer.add_token_list([f"t{i}" for i in range(2048)])
    for name, value in dict(tensors).items():
        writer.add_tensor(name, value.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def trained():
    """The overfitted drafter's architecture, without training it: only its configuration is compared."""
    return architecture(build_drafter(TARGET, LAYER_IDS, block_size=B, num_layers=1).config)


def problems(tmp_path, trained, target_arch="qwen3", **changes):
    fields = {k: v for k, v in {**CONVERTED, **changes}.items() if v is not None}
    path = write_gguf(str(tmp_path / "draft.gguf"), fields)
    return llama_cpp.gguf_problems(llama_cpp.read_gguf_fields(path), trained, target_arch, 8)


def test_the_converters_gguf_reads_back_as_the_trained_drafter(tmp_path, trained):
    assert problems(tmp_path, trained) == []
    fields = llama_cpp.read_gguf_fields(write_gguf(str(tmp_path / "d.gguf"), CONVERTED))
    assert llama_cpp.gguf_architecture(fields)["layer_ids"] == LAYER_IDS  # target_layers [2, 4, 6] are ids + 1


@pytest.mark.parametrize("field, change", [
    # the converter variant that writes ids without the + 1: llama.cpp would tap one layer lower
    ("layer_ids", {"dflash.target_layers": [1, 3, 5]}),
    ("layer_causal", {"dflash.attention.causal": True}),
    ("block_size", {"dflash.block_size": None}),  # common/speculative.cpp falls back to 16
    ("mask_token_id", {"tokenizer.ggml.mask_token_id": 2}),
    ("layer_windows", {"dflash.attention.sliding_window": 24, "dflash.attention.sliding_window_pattern": [True]}),
    ("rope_parameters", {"dflash.rope.freq_base": 1e6}),
    ("num_key_value_heads", {"dflash.attention.head_count_kv": 4}),
])
def test_a_gguf_llama_cpp_would_serve_differently_is_refused_naming_the_field(tmp_path, trained, field, change):
    fields = {k: v for k, v in {**CONVERTED, **change}.items() if v is not None}
    path = write_gguf(str(tmp_path / "draft.gguf"), fields)
    found = llama_cpp.gguf_problems(llama_cpp.read_gguf_fields(path), trained, "qwen3", 8)
    assert [line.split(":")[0] for line in found] == [field], found
    with pytest.raises(ExportError, match=field):
        llama_cpp.check_gguf(path, trained, {"architecture": "qwen3", "num_layers": 8})


def test_a_tap_of_the_targets_last_layer_is_refused_where_its_graph_does_not_expose_it():
    # our id 7 of an 8-layer target is GGUF target_layers 8: t_layer_inp[n_layer], set by nemotron-h, not by qwen3
    assert llama_cpp.target_tap_problems([1, 3, 7], "nemotron_h", 8) == []
    (line,) = llama_cpp.target_tap_problems([1, 3, 7], "qwen3", 8)
    assert line.startswith("layer_ids: layer id 7") and "layer input tensor is null" in line
    assert llama_cpp.target_tap_problems([1, 3, 6], "qwen3", 8) == []


def test_export_gguf_refuses_a_drafter_tapping_the_last_layer_before_converting(tmp_path):
    drafter = build_drafter(TARGET, [1, 3, 7], block_size=B, num_layers=1)
    with pytest.raises(ExportError, match="layer id 7"):
        llama_cpp.export_gguf(drafter, str(tmp_path / "draft.gguf"), TARGET, version="not-built")
    assert os.listdir(tmp_path) == []


def test_export_gguf_refuses_a_lilicorr_drafter_naming_its_field_before_converting(tmp_path):
    """llama.cpp's DFlash builds no lattice: a LiLiCorr drafter would be served as its backbone alone."""
    drafter = build_drafter(TARGET, LAYER_IDS, block_size=B, num_layers=1, lilicorr_candidate_topk=4,
                            lilicorr_hidden_size=32, lilicorr_num_heads=2, lilicorr_factor_dim=8)
    with pytest.raises(ExportError, match="lilicorr_candidate_topk=4.*--format zlab"):
        llama_cpp.export_gguf(drafter, str(tmp_path / "draft.gguf"), TARGET, version="not-built")
    assert os.listdir(tmp_path) == []


def test_tensors_are_compared_by_their_gguf_names_and_a_changed_one_is_named(tmp_path):
    tensors = {"fc.weight": torch.randn(8, 24), "layers.0.self_attn.q_proj.weight": torch.randn(8, 8)}
    stored = {llama_cpp.gguf_name(k): v for k, v in tensors.items()}
    assert sorted(stored) == ["blk.0.attn_q.weight", "fc.weight"]
    path = write_gguf(str(tmp_path / "t.gguf"), CONVERTED, stored)
    assert llama_cpp.tensor_problems(path, tensors) == []
    changed = dict(tensors, **{"layers.0.self_attn.q_proj.weight": tensors["layers.0.self_attn.q_proj.weight"] + 1e-3})
    (line,) = llama_cpp.tensor_problems(path, changed)
    assert line.startswith("layers.0.self_attn.q_proj.weight: blk.0.attn_q.weight differs")
    assert "holds 2 tensors, the drafter 3" in llama_cpp.tensor_problems(path, dict(tensors, **{"norm.weight":
                                                                                                torch.ones(8)}))[0]


# What the vendored converter adds for the overfitted "dflash2" drafter (tests/overfit_drafters.py: conv 2 x 16,
# selector rank 16, top-8), read back from a real conversion on 2026-12-07; src/models/dflash.cpp builds the
# convolutions and the selector only when selector_hidden.weight is there.
CONVERTED_DFLASH2 = {**CONVERTED, "dflash.conv_kernel_size": 2, "dflash.conv_group_size": 16,
                     "dflash.selector_rank": 16, "dflash.selector_top_k": 8}
SELECTOR = {"selector_hidden.weight": torch.zeros(16, 128)}


@pytest.mark.parametrize("fields, tensors, named", [
    ({}, SELECTOR, []),
    # the fields without the selector's tensors: llama.cpp builds plain DFlash, and its walk aborts on no lattice
    ({}, {}, ["conv_kernel_size", "selector_rank", "selector_top_k", "selector_top_k"]),
    ({"dflash.selector_top_k": 11}, SELECTOR, ["selector_top_k", "selector_top_k"]),  # 11 * 12 > 128: refused
    ({"dflash.conv_group_size": 32}, SELECTOR, ["conv_group_size"]),
    ({"dflash.selector_rank": None}, SELECTOR, ["selector_rank", "selector_rank"]),  # llama.cpp refuses to load
])
def test_a_dflash2_gguf_is_read_as_llama_cpp_builds_it(tmp_path, fields, tensors, named):
    trained = architecture(build_drafter(TARGET, LAYER_IDS, block_size=B, **DRAFTERS["dflash2"]).config)
    merged = {k: v for k, v in {**CONVERTED_DFLASH2, **fields}.items() if v is not None}
    path = write_gguf(str(tmp_path / "draft.gguf"), merged, tensors)
    found = llama_cpp.gguf_problems(llama_cpp.read_gguf_fields(path), trained, "qwen3", 8)
    assert [line.split(":")[0] for line in found] == named, found


def test_dflash2_tensors_have_the_converters_gguf_names():
    names = {k: llama_cpp.gguf_name(k) for k in build_drafter(TARGET, LAYER_IDS, block_size=B,
                                                             **DRAFTERS["dflash2"]).state_dict()}
    assert None not in names.values(), names
    assert names["layers.0.mlp_conv.kernel_projection.weight"] == "blk.0.ffn_conv_proj.weight"
    assert names["candidate_selector.predecessor_codebook"] == "selector_predecessor.weight"


# What the vendored converter adds for the overfitted "dspark" drafter (Markov rank 16, a confidence head, drafting
# from the anchor) from our speculators export, read back from a real conversion on 2026-12-07.
CONVERTED_DSPARK = {**CONVERTED, "dflash.sample_from_anchor": True, "dflash.has_confidence_head": True}
MARKOV = {"markov_w1.weight": torch.zeros(2048, 16), "markov_w2.weight": torch.zeros(2048, 16)}
CONFIDENCE = {"conf_proj.weight": torch.zeros(1, 144), "conf_proj.bias": torch.zeros(1)}


@pytest.mark.parametrize("fields, tensors, named", [
    ({}, {**MARKOV, **CONFIDENCE}, []),
    # no Markov head: llama.cpp serves it as draft-dflash (common/speculative.cpp auto-detects by markov_w1.weight)
    ({}, {}, ["sample_from_anchor", "markov_rank", "confidence_head"]),
    ({}, MARKOV, ["confidence_head"]),  # a Markov head without the confidence head
    ({"dflash.sample_from_anchor": False}, {**MARKOV, **CONFIDENCE}, ["sample_from_anchor"]),
    ({"dflash.sample_from_anchor": None}, {**MARKOV, **CONFIDENCE}, []),  # absent reads as true
    ({}, {"markov_w1.weight": torch.zeros(2048, 8), "markov_w2.weight": torch.zeros(2048, 8),
          "conf_proj.weight": torch.zeros(1, 136)}, ["markov_rank"]),
])
def test_a_dspark_gguf_is_read_as_llama_cpp_builds_it(tmp_path, fields, tensors, named):
    trained = architecture(build_drafter(TARGET, LAYER_IDS, block_size=B, **DRAFTERS["dspark"]).config)
    merged = {k: v for k, v in {**CONVERTED_DSPARK, **fields}.items() if v is not None}
    path = write_gguf(str(tmp_path / "draft.gguf"), merged, tensors)
    found = llama_cpp.gguf_problems(llama_cpp.read_gguf_fields(path), trained, "qwen3", 8)
    assert [line.split(":")[0] for line in found] == named, found


def test_export_gguf_refuses_a_dspark_markov_head_llama_cpp_does_not_build_before_converting(tmp_path):
    drafter = build_drafter(TARGET, LAYER_IDS, block_size=B, **dict(DRAFTERS["dspark"], markov_head_type="gated"))
    with pytest.raises(ExportError, match="markov_head_type='gated'"):
        llama_cpp.export_gguf(drafter, str(tmp_path / "draft.gguf"), TARGET, version="not-built")
    assert os.listdir(tmp_path) == []


def test_the_embedded_targets_pre_tokenizer_is_named_qwen2_and_another_regex_is_not(tmp_path):
    assert llama_cpp.pre_tokenizer(TARGET) == "qwen2"
    with open(os.path.join(TARGET, "tokenizer.json")) as f:
        tokenizer = json.load(f)
    tokenizer["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\s+"
    with open(tmp_path / "tokenizer.json", "w") as f:
        json.dump(tokenizer, f)
    assert llama_cpp.pre_tokenizer(str(tmp_path)) is None


def test_tau_after_first_step_leaves_out_each_prompts_first_step_and_the_spec_type_is_passed(monkeypatch):
    """evaluate_llama_cpp's tau over every step and without each prompt's first (the block anchored at the prompt's
    last token), from the tools' per-step counts; the speculative type and n_max reach llama-speculative-simple."""
    from dflash_fast.evaluate import llama_cpp as runner

    steps = {"a": [0, 3, 3], "b": [1, 2]}
    calls = []

    def with_drafter(*args, spec_type):
        calls.append((spec_type, args[5]))  # (bin_dir, target, draft, prompt, max_new_tokens, n_max, threads)
        return {"text": "x", "accepted": steps[args[3]], "tau": None, "tokens_per_s": 1.0}

    monkeypatch.setattr(runner, "target_alone", lambda *_: {"text": "x", "tokens_per_s": 2.0})
    monkeypatch.setattr(runner, "with_drafter", with_drafter)
    report = runner.evaluate_llama_cpp("bin", "t", "d", ["a", "b"], 8, spec_type="draft-dspark", n_max=4)
    assert report["tau"] == (1 + 4 + 4 + 2 + 3) / 5 and report["tau_after_first_step"] == (4 + 4 + 3) / 3
    assert calls == [("draft-dspark", 4)] * 2 and report["greedy_mismatches"] == 0


# ---------------------------------------------------------------- llama.cpp itself


TOOLS = ("llama-speculative-simple", "llama-simple")


def _tools():
    bin_dir = os.path.join(llama_cpp.cache_root(), "bin")
    have = all(os.access(os.path.join(bin_dir, t), os.X_OK) for t in TOOLS)
    if not have and os.environ.get("DFLASH_REQUIRE_LLAMA_CPP") != "1":
        pytest.skip("llama.cpp's tools are not built: scripts/build_llama_cpp.sh (DFLASH_REQUIRE_LLAMA_CPP=1 builds)")
    return llama_cpp.build_tools(TOOLS)


@pytest.fixture(scope="module")
def target_gguf(tmp_path_factory):
    """(tools' directory, the embedded target converted by the vendored converter)."""
    bin_dir = _tools()
    return bin_dir, llama_cpp.convert(TARGET, str(tmp_path_factory.mktemp("llama_cpp") / "target.gguf"))


def _served(target_gguf, kind: str):
    bin_dir, target = target_gguf
    drafter = overfit(kind)
    draft = llama_cpp.export_gguf(drafter, os.path.join(os.path.dirname(target), f"{kind}.gguf"), TARGET)
    return bin_dir, target, draft, drafter


@pytest.fixture(scope="module")
def served(target_gguf):
    """(tools' directory, target GGUF, drafter GGUF, the trained drafter): the embedded target and the overfitted
    full drafter converted by the vendored converter, the drafter through export_gguf's gate."""
    return _served(target_gguf, "full")


# Alignment differs (evaluate/llama_cpp.py): llama.cpp anchors its first block at the prompt's last token, ours at
# the first new token, so each engine's blocks split the same output differently. Measured 2026-12-07: see
# docs/llama-cpp.md. Outputs must be the same tokens.
TAU_TOLERANCE = 0.25


def served_beside_ours(served, **spec) -> tuple:
    """(our evaluator's report, llama.cpp's) of the same eval prompts, `spec` the speculative type and draft count
    evaluate_llama_cpp takes; llama.cpp's speculative output must be the target's greedy output, and ours."""
    from transformers import AutoTokenizer

    bin_dir, target, draft, drafter = served
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    prompts = [tokenizer.decode(encode_prompt(tokenizer, p)) for p in read_prompts(PROMPTS, NUM_PROMPTS)]
    ours = evaluate(TARGET, PROMPTS, drafter, max_new_tokens=NEW_TOKENS, num_prompts=NUM_PROMPTS, offline=False,
                    progress=False)
    served_report = evaluate_llama_cpp(bin_dir, target, draft, prompts, NEW_TOKENS, **spec)
    print(json.dumps({"tau_ours": ours["tau"], "tau_llama_cpp": served_report["tau"],
                      "tau_llama_cpp_after_first_step": served_report["tau_after_first_step"],
                      "tokens_per_s_target": served_report["tokens_per_s_target"],
                      "tokens_per_s_speculative": served_report["tokens_per_s_speculative"],
                      "accepted": [r["accepted"] for r in served_report["per_prompt"]]}))
    assert served_report["greedy_mismatches"] == 0, [(r["text_target"], r["text_speculative"])
                                                     for r in served_report["per_prompt"]]
    for row, mine in zip(served_report["per_prompt"], ours["per_prompt"]):
        text = tokenizer.decode(mine["tokens"])
        n = min(len(text), len(row["text_target"]))
        assert n > 0 and row["text_target"][:n] == text[:n], (row["text_target"], text)
    return ours, served_report


def test_llama_cpp_serves_our_export_with_the_targets_greedy_output_and_our_acceptance(served):
    draft = served[2]
    fields = llama_cpp.read_gguf_fields(draft)
    assert fields["dflash.target_layers"] == [i + 1 for i in LAYER_IDS]
    assert llama_cpp.draft_settings(fields) == ("draft-dflash", B - 1)
    ours, served_report = served_beside_ours(served)
    assert ours["tau"] > 1.5  # the drafter accepts: the comparison is not of two idle drafters
    assert abs(served_report["tau"] - ours["tau"]) <= TAU_TOLERANCE, (served_report["tau"], ours["tau"])


# DFlash2 in llama.cpp (common/speculative.cpp draft, is_dflash2): the walk is ours and vLLM's (spec.md §9): slot
# 1's predecessor is the anchor token, each later slot's the candidate chosen before it, greedy by the best score
# over the slot's unary top-K (src/models/dflash.cpp build_dflash2_selector packs those scores). What differs is
# the alignment above: llama.cpp's first step per prompt drafts from the prompt's last token, which ours does not
# draft (prompts 0 and 1 measured: the same steps as ours after it). tau_after_first_step leaves that step out.
# Measured 2026-12-07 (this shared 2-core CPU): ours 3.808, llama.cpp 3.452 (all steps), 3.679 (after the first).
DFLASH2_TAU_TOLERANCE = 0.25


@pytest.fixture(scope="module")
def served_dflash2(target_gguf):
    return _served(target_gguf, "dflash2")


def test_llama_cpp_serves_our_dflash2_export_with_the_targets_greedy_output_and_our_acceptance(served_dflash2):
    fields = llama_cpp.read_gguf_fields(served_dflash2[2])
    assert fields["dflash.selector_top_k"] == 8 and "selector_hidden.weight" in fields["__tensors__"]
    assert llama_cpp.draft_settings(fields) == ("draft-dflash", B - 1)  # the selector switches itself on
    ours, served_report = served_beside_ours(served_dflash2)
    assert ours["tau"] > 2.5  # the selector's walk accepts most of each block: not two idle drafters
    assert abs(served_report["tau_after_first_step"] - ours["tau"]) <= DFLASH2_TAU_TOLERANCE, (
        served_report["tau_after_first_step"], ours["tau"])


# DSpark in llama.cpp (draft-dspark, common/speculative.cpp draft is_dspark; src/models/dflash.cpp
# build_dspark_markov_head): drafting from the anchor, B slots after [id_last, mask * (B - 1)], each slot's logits
# biased by W2 W1[prev], prev the anchor's token then each slot's argmax: our walk (spec.md §8). The confidence head
# is read only with --spec-draft-p-min > 0 (not here). Measured 2026-12-07 (this shared 2-core CPU): ours 3.241,
# llama.cpp 3.029 (all steps), 3.156 (after each prompt's first); after the first step each prompt's steps are ours.
DSPARK_TAU_TOLERANCE = 0.25


@pytest.fixture(scope="module")
def served_dspark(target_gguf):
    return _served(target_gguf, "dspark")


def test_llama_cpp_serves_our_dspark_export_with_the_targets_greedy_output_and_our_acceptance(served_dspark):
    fields = llama_cpp.read_gguf_fields(served_dspark[2])
    assert "markov_w1.weight" in fields["__tensors__"] and fields["dflash.sample_from_anchor"] is True
    # drafting from the anchor, llama.cpp drafts B tokens a step (common/speculative.cpp n_draft_max): the settings
    # evaluate_llama_cpp reads from the GGUF when not given
    assert llama_cpp.draft_settings(fields) == ("draft-dspark", B)
    assert llama_cpp.draft_settings(dict(fields, **{"dflash.sample_from_anchor": False})) == ("draft-dspark", B - 1)
    ours, served_report = served_beside_ours(served_dspark)
    assert ours["tau"] > 2.5
    assert abs(served_report["tau_after_first_step"] - ours["tau"]) <= DSPARK_TAU_TOLERANCE, (
        served_report["tau_after_first_step"], ours["tau"])


def test_a_drafter_converted_without_the_plus_one_is_refused_by_the_gate(served):
    """The stored converter variant that writes ids without + 1, reproduced on a real conversion: the gate names
    layer_ids."""
    _, _, draft, drafter = served
    fields = llama_cpp.read_gguf_fields(draft)
    fields["dflash.target_layers"] = [i - 1 for i in fields["dflash.target_layers"]]
    found = llama_cpp.gguf_problems(fields, architecture(drafter.config), "qwen3", 8)
    assert [line.split(":")[0] for line in found] == ["layer_ids"]



def test_export_format_gguf_wants_a_gguf_file_and_no_card(tmp_path, capsys):
    from dflash_fast.cli import main

    assert main(["export", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "draft"), "--format", "gguf"]) == 1
    assert "--out is the GGUF file to write" in capsys.readouterr().err
    assert main(["export", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "d.gguf"), "--format", "gguf",
                 "--card-from", str(tmp_path / "eval.json")]) != 0


def test_the_export_command_writes_the_gguf_the_gate_passed(served, tmp_path, monkeypatch, capsys):
    """`dflash-fast export --format gguf` on the served drafter (a stand-in for the checkpoint reader): the GGUF it
    writes holds the trained tensors, and llama.cpp's reading of it is the trained drafter."""
    from dflash_fast.cli import main
    from dflash_fast.train import export_checkpoint

    _, _, _, drafter = served
    monkeypatch.setattr(export_checkpoint, "load_checkpoint_for_export", lambda path: (drafter, TARGET, {}, path))
    out = str(tmp_path / "draft.gguf")
    assert main(["export", "--checkpoint", str(tmp_path), "--out", out, "--format", "gguf", "--dtype", "bf16"]) == 0
    assert "read back as llama.cpp reads it" in capsys.readouterr().out
    fields = llama_cpp.read_gguf_fields(out)
    assert llama_cpp.gguf_problems(fields, architecture(drafter.config), "qwen3", 8) == []
    written = {k: v.to(torch.bfloat16) for k, v in drafter.state_dict().items()}
    assert llama_cpp.tensor_problems(out, written) == [] and os.listdir(tmp_path) == ["draft.gguf"]
