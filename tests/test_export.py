"""Export serves exactly as it trained: every drafter option through both layouts and the serving side's own
config classes, the gate that refuses a mismatch, published drafters loaded back, hostile exports refused.

What runs for real here: transformers' Qwen3Config / AutoConfig / Qwen3RotaryEmbedding and safetensors. What
does not (not installed, GPU-only): speculators, vLLM, SGLang; their config handling is reproduced in
dflash_fast/serve/engines.py (`_speculators_view`, `_vllm_speculators_view`, `_sglang_view`, `_vllm_zlab_view`, each
citing the file and function it follows) and pinned below against what those files do.
"""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_drafter import random_batch, small_config
from test_trainer import TINY_YAML, settings, tiny  # noqa: F401 (tiny: the store fixture, shared with test_trainer)
from transformers import AutoConfig, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from dflash_fast.drafter.config import DrafterConfig
from dflash_fast.drafter.layers import Rope
from dflash_fast.drafter.model import DFlashDrafter
from dflash_fast.serve import engines, export, layouts
from dflash_fast.serve.architecture import architecture
from dflash_fast.serve.engines import ENGINES, SERVING_RULES, config_from_export, served_architectures
from dflash_fast.serve.export import export_drafter, gate_batch, gate_logits, load_exported
from dflash_fast.serve.layouts import FORMATS, ExportError

V, H, B = 96, 32, 4


def make_config(**kw) -> DrafterConfig:
    """test_drafter's small drafter (H = 32, V = 96, 3 tapped layers, 2 layers, block 4), long enough positions
    for the RoPE scalings below."""
    return small_config(**{"max_position_embeddings": 512, **kw})


def make_drafter(seed=0, **kw) -> DFlashDrafter:
    torch.manual_seed(seed)
    d = DFlashDrafter(make_config(**kw))
    d.reset_parameters(std=0.2)
    v, h = d.config.vocab_size, d.config.hidden_size
    d.set_frozen(torch.randn(v, h), torch.randn(v, h), 1 + 0.1 * torch.randn(h))
    return d


def written_config(export_dir: str) -> dict:
    with open(os.path.join(export_dir, "config.json")) as f:
        return json.load(f)


def layer_config(config: dict, fmt: str) -> dict:
    return config["transformer_layer_config"] if fmt == "speculators" else config


# name -> (drafter options, {format refused: what the error names})
CASES = {
    "full_layers": ({}, {}),
    "sliding_bidirectional": (
        dict(layer_types=["full", "sliding"], sliding_window=5),
        {"zlab": r"layer_causal: trained \[False, False\], sglang serves \[False, True\]"},
    ),
    "sliding_causal": (dict(layer_types=["sliding", "sliding"], sliding_window=6, causal_in_block=True), {}),
    "zlab_pattern_sliding_causal_full_bidirectional": (
        dict(num_layers=3, layer_types=["sliding", "sliding", "full"], sliding_window=5,
             causal_in_block=[True, True, False]),
        {"speculators": r"layer_causal: trained \[True, True, False\], vllm serves \[True, True, True\]"},
    ),
    "causal_full_layers": (
        dict(causal_in_block=True),
        {"speculators": r"layer_causal: trained \[True, True\], speculators serves \[False, False\]",
         "zlab": r"layer_causal: trained \[True, True\], sglang serves \[False, False\]"},
    ),
    "sliding_layers_of_both_rules": (
        dict(layer_types=["sliding", "sliding"], sliding_window=5, causal_in_block=[True, False]),
        {"speculators": r"layer_causal: trained \[True, False\], speculators serves \[True, True\]",
         "zlab": r"layer_causal: trained \[True, False\], sglang serves \[True, True\]"},
    ),
    "head_dim_and_gqa": (dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16), {}),
    "rope_yarn": (
        dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                              "original_max_position_embeddings": 128}),
        {},
    ),
    "rope_linear": (dict(rope_parameters={"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}), {}),
    "rope_llama3": (
        dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 128}),
        {},
    ),
    "partial_rotary": (
        dict(rope_parameters={"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5}),
        {"zlab": r"rope_parameters: .*sglang serves .*rotary_dim=head_dim"},
    ),
    "yarn_partial_rotary": (
        dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                              "original_max_position_embeddings": 128, "partial_rotary_factor": 0.5}),
        {"zlab": r"rope_parameters: .*sglang serves"},
    ),
    "eps_mask_block_vocab_layer_ids": (
        dict(rms_norm_eps=1e-5, mask_token_id=7, block_size=6, vocab_size=80, layer_ids=[1, 3], target_num_layers=6),
        {},
    ),
    "target_hidden_differs": (
        dict(target_hidden_size=24),
        {fmt: r"target_hidden_size: trained 24, (speculators|sglang) serves 32" for fmt in FORMATS},
    ),
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", list(CASES))
def test_every_drafter_option_serves_as_it_trained(case, fmt, tmp_path):
    options, refused = CASES[case]
    d = make_drafter(**options)
    out = tmp_path / "export"
    if fmt in refused:
        with pytest.raises(ExportError, match=refused[fmt]):
            export_drafter(d, str(out), "tiny-target", torch.float32, fmt=fmt)
        assert os.listdir(tmp_path) == [], "a refused export leaves nothing behind"
        return
    export_drafter(d, str(out), "tiny-target", torch.float32, fmt=fmt)
    assert sorted(os.listdir(tmp_path)) == ["export"]
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    cfg = d.config
    # the serving side's own config class (speculators: Qwen3Config of transformer_layer_config; SGLang and vLLM
    # read the z-lab layout with AutoConfig) keeps every field
    hf = Qwen3Config(**layer_config(config, fmt)) if fmt == "speculators" else AutoConfig.from_pretrained(str(out))
    assert type(hf) is Qwen3Config
    sliding = "sliding" in cfg.layer_types
    assert hf.sliding_window == (cfg.sliding_window if sliding else None)
    assert hf.layer_types == [{"full": "full_attention", "sliding": "sliding_attention"}[k] for k in cfg.layer_types]
    assert (hf.head_dim, hf.num_attention_heads, hf.num_key_value_heads) == (
        cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads)
    assert (hf.rms_norm_eps, hf.vocab_size, hf.num_hidden_layers) == (cfg.rms_norm_eps, cfg.vocab_size, cfg.num_layers)
    assert hf.rope_parameters == cfg.rope_parameters
    # every engine of the format builds the trained architecture (the window rule: test_window_rule_* below)
    served = served_architectures(config)
    assert sorted(served) == sorted(ENGINES[fmt])
    built = lambda arch: {k: v for k, v in arch.items() if k not in SERVING_RULES}  # noqa: E731
    for engine, arch in served.items():
        assert built(arch) == built(architecture(cfg)), engine
    back = load_exported(str(out))
    assert back.config == cfg
    back.set_frozen(d.embed_tokens, d.lm_head, d.target_norm)
    batch = gate_batch(cfg)
    assert torch.equal(gate_logits(back, batch), gate_logits(d, batch))


SLIDING_CAUSAL = dict(layer_types=["sliding", "sliding"], sliding_window=6, causal_in_block=True)


@pytest.mark.parametrize(
    "window_from, fmt, warned",
    [("anchor", "speculators", ["vllm serves 'query'"]), ("anchor", "zlab", ["sglang serves 'query'",
                                                                           "vllm serves 'query'"]),
     ("query", "speculators", ["speculators serves 'anchor'"]), ("query", "zlab", [])],
)
def test_window_rule_an_engine_serves_otherwise_is_warned_of_naming_model_window_from(window_from, fmt, warned,
                                                                                        tmp_path):
    """vLLM and SGLang end a sliding window at each query's own position, speculators trains it at the anchor
    (spec.md §4): the export is written, with one warning line per engine that serves the other rule."""
    lines = []
    d = make_drafter(**SLIDING_CAUSAL, window_from=window_from)
    export_drafter(d, str(tmp_path / "export"), "tiny-target", torch.float32, fmt=fmt, warn=lines.append)
    assert len(lines) == len(warned)
    for line, engine in zip(lines, warned):
        assert f"model.window_from: trained '{window_from}', {engine}" in line and line.startswith("warning: ")
    assert not [line for line in lines if "window_from" not in line]


def test_window_rule_is_read_back_as_trained_and_old_exports_read_as_the_spec_rule(tmp_path):
    d = make_drafter(**SLIDING_CAUSAL, window_from="query")
    out = export_drafter(d, str(tmp_path / "export"), "tiny-target", torch.float32, fmt="zlab", warn=None)
    assert load_exported(out).config.window_from == "query"
    config = written_config(out)
    del config["dflash_fast"]["window_from"]  # an export written before the field
    assert config_from_export(config).window_from == "anchor"
    config["dflash_fast"]["window_from"] = "slot"
    with pytest.raises(ExportError, match=r"dflash_fast.window_from='slot' is not one of \('anchor', 'query'\)"):
        config_from_export(config)


SPECULATORS_NAMES = ["fc.weight", "hidden_norm.weight", "norm.weight"] + [
    f"layers.{i}.{n}"
    for i in range(2)
    for n in (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    )
]


def test_export_round_trip_names_and_layer_ids(tmp_path):
    """Moved from test_drafter.py."""
    from safetensors import safe_open

    d = make_drafter(layer_types=["full", "sliding"], sliding_window=5)
    export_drafter(d, str(tmp_path), verifier="tiny-target", dtype=torch.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["architectures"] == ["DFlashDraftModel"]
    assert config["aux_hidden_state_layer_ids"] == [1, 2, 3], "speculators numbers layers one higher"
    assert config["block_size"] == B and config["mask_token_id"] == V - 1 and config["draft_vocab_size"] == V
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(SPECULATORS_NAMES), "frozen verifier tensors must not be exported"
        assert f.get_tensor("fc.weight").shape == (H, 3 * H)
        assert f.get_tensor("layers.0.self_attn.k_proj.weight").shape == (2 * 8, H)
    back = load_exported(str(tmp_path))
    back.set_frozen(d.embed_tokens, d.lm_head, d.target_norm)
    assert back.config == d.config
    for (n1, p1), (n2, p2) in zip(d.named_parameters(), back.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    batch = random_batch()
    assert torch.equal(d(batch, "kl").loss, back(batch, "kl").loss)


def test_sliding_window_survives_the_reload_through_qwen3config(tmp_path):
    """Issue 12: the export wrote no use_sliding_window, so Qwen3Config(**transformer_layer_config) dropped the
    window and the sliding layers served as full attention."""
    d = make_drafter(layer_types=["full", "sliding"], sliding_window=5)
    export_drafter(d, str(tmp_path / "export"), "tiny-target", torch.float32)
    layer = json.loads((tmp_path / "export" / "config.json").read_text())["transformer_layer_config"]
    hf = Qwen3Config(**layer)
    assert hf.layer_types == ["full_attention", "sliding_attention"]
    assert hf.sliding_window == 5, "the sliding layer would be served as full attention"


def test_a_drafter_whose_window_the_engines_drop_is_never_written(tmp_path, monkeypatch):
    """The gate is what makes the issue-12 class of bug unshippable: reintroduce it and the export is refused."""
    original = layouts.qwen3_layer

    def without_use_sliding_window(cfg):
        layer = original(cfg)
        layer.pop("use_sliding_window")
        return layer

    monkeypatch.setattr(layouts, "qwen3_layer", without_use_sliding_window)
    d = make_drafter(layer_types=["full", "sliding"], sliding_window=5)
    with pytest.raises(ExportError, match=r"layer_windows: trained \[None, 5\], speculators serves \[None, None\]"):
        export_drafter(d, str(tmp_path / "export"), "tiny-target", torch.float32)
    assert os.listdir(tmp_path) == []


def test_the_gate_compares_logits_of_the_written_weights(tmp_path, monkeypatch):
    import safetensors.torch

    real_save = safetensors.torch.save_file

    def save_a_different_q_proj(tensors, path, metadata=None):
        name = "layers.1.self_attn.q_proj.weight"
        tensors = dict(tensors, **{name: tensors[name] + 0.01})
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", save_a_different_q_proj)
    with pytest.raises(ExportError, match="other logits than the trained one"):
        export_drafter(make_drafter(), str(tmp_path / "export"), "tiny-target", torch.float32)
    assert os.listdir(tmp_path) == []


def test_weights_that_overflow_the_export_dtype_are_refused(tmp_path):
    d = make_drafter()
    with torch.no_grad():
        d.layers[0].mlp.up_proj.weight[0, 0] = 1e6
    with pytest.raises(ExportError, match=r"layers\.0\.mlp\.up_proj\.weight holds non-finite values"):
        export_drafter(d, str(tmp_path / "export"), "tiny-target", torch.float16)
    assert os.listdir(tmp_path) == []


def test_the_layer_ids_of_each_layout(tmp_path):
    d = make_drafter(layer_ids=[0, 2, 4], target_num_layers=6)
    spec = written_config(export_drafter(d, str(tmp_path / "s"), "t", torch.float32))
    zlab = written_config(export_drafter(d, str(tmp_path / "z"), "t", torch.float32, fmt="zlab"))
    assert spec["aux_hidden_state_layer_ids"] == [1, 3, 5], "speculators numbers the same tensors one higher"
    assert zlab["dflash_config"]["target_layer_ids"] == [0, 2, 4], "z-lab reads hidden_states[id + 1], as we do"
    assert zlab["num_target_layers"] == 6
    assert spec["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == B - 1
    assert spec["sample_from_anchor"] is False


def test_zlab_config_holds_every_key_the_reference_loaders_read(tmp_path):
    """The keys z-lab/dflash reads from a published drafter (dflash/model.py DFlashDraftModel, dflash/model_mlx.py
    load_draft) and SGLang's parse_dflash_draft_config."""
    d = make_drafter(layer_types=["sliding", "full"], sliding_window=5, causal_in_block=[True, False])
    config = written_config(export_drafter(d, str(tmp_path / "z"), "t", torch.float32, fmt="zlab"))
    mlx_reads = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings",
                 "block_size", "num_target_layers"]
    assert all(key in config for key in mlx_reads), [k for k in mlx_reads if k not in config]
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"target_layer_ids": [0, 1, 2], "mask_token_id": V - 1, "block_size": B}
    assert config["use_sliding_window"] is True and config["sliding_window"] == 5
    assert "auto_map" not in config, "no remote code is shipped, so none may be named"
    with open(os.path.join(tmp_path, "z", "model.safetensors"), "rb"):
        names = sorted(load_file(str(tmp_path / "z" / "model.safetensors")))
    assert names == sorted(n for n, _ in d.named_parameters()), "the trainable weights, z-lab's names"


def test_zlab_export_imports_back_identical_and_re_exports_the_same_config(tmp_path):
    d = make_drafter(num_layers=3, layer_types=["sliding", "sliding", "full"], sliding_window=5,
                     causal_in_block=[True, True, False])
    first = export_drafter(d, str(tmp_path / "first"), "t", torch.float32, fmt="zlab")
    back = load_exported(first)
    assert back.config == d.config
    for (name, p), (_, q) in zip(d.named_parameters(), back.named_parameters()):
        assert torch.equal(p, q), name
    second = export_drafter(back, str(tmp_path / "second"), "t", torch.float32, fmt="zlab")
    assert written_config(first) == written_config(second)


def published_zlab_drafter(directory, layer_ids=(0, 2), **edits):
    """A drafter laid out like z-lab's published ones (HF-saved Qwen3 config with auto_map, transformers 4 RoPE
    keys, sliding layers causal for SGLang), with random weights of the right shapes."""
    config = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "dtype": "bfloat16",
        "hidden_act": "silu",
        "hidden_size": H,
        "head_dim": 8,
        "intermediate_size": 64,
        "initializer_range": 0.02,
        "max_position_embeddings": 512,
        "max_window_layers": 3,
        "num_attention_heads": 4,
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "use_sliding_window": True,
        "sliding_window": 6,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": V,
        "block_size": B,
        "num_target_layers": 5,
        "dflash_config": {"mask_token_id": V - 2, "target_layer_ids": list(layer_ids)},
    }
    config.update(edits)
    torch.manual_seed(3)
    shapes = DFlashDrafter(
        make_config(num_layers=3, layer_ids=list(layer_ids), head_dim=8, layer_types=["sliding", "sliding", "full"],
                    sliding_window=6, mask_token_id=V - 2)
    )
    weights = {n: torch.randn(p.shape).to(torch.bfloat16) for n, p in shapes.named_parameters()}
    os.makedirs(directory, exist_ok=True)
    save_file(weights, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return weights


def test_a_published_zlab_drafter_loads_as_sglang_serves_it(tmp_path):
    weights = published_zlab_drafter(tmp_path / "pub")
    d = load_exported(str(tmp_path / "pub"))
    cfg = d.config
    assert cfg.layer_ids == [0, 2] and cfg.mask_token_id == V - 2 and cfg.block_size == B
    assert cfg.layer_types == ["sliding", "sliding", "full"] and cfg.sliding_window == 6
    assert cfg.causal_in_block == [True, True, False], "SGLang: sliding layers DECODER (causal), full ENCODER_ONLY"
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 1000000.0}
    assert cfg.target_num_layers == 5
    for name, p in d.named_parameters():
        assert torch.equal(p, weights[name].float()), name
    # and it can be written again in its layout, gated; vLLM would serve a speculators export of it all causal
    export_drafter(d, str(tmp_path / "again"), "t", torch.bfloat16, fmt="zlab")
    with pytest.raises(ExportError, match=r"trained \[True, True, False\], vllm serves \[True, True, True\]"):
        export_drafter(d, str(tmp_path / "spec"), "t", torch.bfloat16, fmt="speculators")
    assert engines.servable_format(cfg) == "zlab"


def test_a_zlab_drafter_without_layer_ids_gets_z_labs_default(tmp_path):
    """dflash/model.py: target_layer_ids default to build_target_layer_ids(num_target_layers, num_hidden_layers)."""
    published_zlab_drafter(tmp_path / "pub", layer_ids=(1, 3, 5), dflash_config={"mask_token_id": V - 2},
                           num_target_layers=8)
    assert load_exported(str(tmp_path / "pub")).config.layer_ids == [1, 3, 5]
    published_zlab_drafter(tmp_path / "shallow", dflash_config={"mask_token_id": V - 2}, num_target_layers=3)
    with pytest.raises(ExportError, match="cannot spread 3 distinct layer ids"):
        load_exported(str(tmp_path / "shallow"))


def test_a_zlab_drafter_of_the_nested_revision_loads(tmp_path):
    """z-lab's later published configs (HF revision c69b185, June 2026) keep block_size only in dflash_config and
    RoPE only in rope_parameters, and name no num_target_layers."""
    published_zlab_drafter(tmp_path / "pub", dflash_config={"mask_token_id": V - 2, "target_layer_ids": [0, 2],
                                                            "block_size": 6},
                           rope_parameters={"rope_type": "default", "rope_theta": 1e7})
    edit_config(tmp_path / "pub", lambda c: [c.pop(k) for k in ("block_size", "rope_theta", "rope_scaling",
                                                                 "num_target_layers")])
    cfg = load_exported(str(tmp_path / "pub")).config
    assert cfg.block_size == 6 and cfg.rope_parameters == {"rope_type": "default", "rope_theta": 1e7}
    assert cfg.layer_ids == [0, 2] and cfg.causal_in_block == [True, True, False]


# ---------------------------------------------------------------- hostile or hand-edited exports


@pytest.fixture()
def spec_export(tmp_path):
    return export_drafter(make_drafter(), str(tmp_path / "export"), "tiny-target", torch.float32)


def edit_config(path, edit):
    config = json.loads(open(os.path.join(path, "config.json")).read())
    edit(config)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def test_an_export_missing_a_key_names_it(spec_export):
    edit_config(spec_export, lambda c: c.pop("mask_token_id"))
    with pytest.raises(ExportError, match="config.json has no 'mask_token_id'"):
        load_exported(spec_export)


def test_a_zlab_export_missing_its_mask_token_names_it(tmp_path):
    published_zlab_drafter(tmp_path / "pub", dflash_config={"target_layer_ids": [0, 2]})
    with pytest.raises(ExportError, match="no dflash_config.mask_token_id"):
        load_exported(str(tmp_path / "pub"))


def test_an_export_with_more_layers_than_weights_is_refused(spec_export):
    def three_layers(c):
        c["transformer_layer_config"]["num_hidden_layers"] = 3
        c["transformer_layer_config"]["layer_types"].append("full_attention")

    edit_config(spec_export, three_layers)
    with pytest.raises(ExportError, match=r"implies 31,024 trainable parameters in 36 tensors \(3 layers\) "
                                          r"but the file holds 21,728 in 25 tensors"):
        load_exported(spec_export)


def test_a_layer_count_that_disagrees_with_layer_types_is_refused(spec_export):
    edit_config(spec_export, lambda c: c["transformer_layer_config"].update(num_hidden_layers=3))
    with pytest.raises(ExportError, match="must be equal to the number of `layer_types`"):
        load_exported(spec_export)


@pytest.mark.parametrize(
    "fmt, edit, error",
    [
        # Layer ids no target layer has. The fc width matches (three ids, three tapped layers), so only the ids
        # themselves can be wrong.
        ("speculators", lambda c: c.update(aux_hidden_state_layer_ids=[0, 2, 3]), r"layer id -1 is negative"),
        ("speculators", lambda c: c.update(aux_hidden_state_layer_ids=[2, 2, 3]), r"\[1, 1, 2\] contain duplicates"),
        ("speculators", lambda c: c.update(aux_hidden_state_layer_ids=["1", 2, 3]),
         r'config.json: aux_hidden_state_layer_ids\[0\] must be an integer, got "1"'),
        ("zlab", lambda c: c["dflash_config"].update(target_layer_ids=[0, 1, 7]),
         r"layer id 7 does not exist: the target has 4 decoder layers"),
        ("zlab", lambda c: c["dflash_config"].update(target_layer_ids="0,1,2"),
         r'config.json: dflash_config.target_layer_ids must be a list of integers, got "0,1,2"'),
        # Values of the wrong kind.
        ("zlab", lambda c: c["dflash_config"].update(block_size="4"), r'dflash_config.block_size must be an integer'),
        ("speculators", lambda c: c.update(mask_token_id=-1), r"mask_token_id=-1 is not an integer >= 0"),
        ("zlab", lambda c: c.update(num_target_layers="4", dflash_fast={}), r'num_target_layers must be an integer'),
        ("speculators", lambda c: c.update(transformer_layer_config=[1]),
         r"config.json: transformer_layer_config must be an object, got a list"),
        ("speculators", lambda c: c.update(speculators_config="greedy"),
         r'speculators_config must be an object, got "greedy"'),
    ],
    ids=["layer_ids_negative", "layer_ids_duplicate", "layer_ids_not_int", "layer_ids_beyond_the_target",
         "layer_ids_a_string", "block_size_string", "negative_mask_token", "target_layers_string", "layer_config_list",
         "proposal_string"],
)
def test_a_hand_edited_value_that_cannot_be_served_is_refused_by_name(tmp_path, fmt, edit, error):
    out = export_drafter(make_drafter(), str(tmp_path / "export"), "tiny-target", torch.float32, fmt=fmt)
    edit_config(out, edit)
    with pytest.raises(ExportError, match=error):
        load_exported(out)



def _set_zlab_layer_id(c):
    c["dflash_config"]["target_layer_ids"] = [0, "1", 2]


@pytest.mark.parametrize(
    "write, edit, error",
    [
        (layouts.speculators_config, lambda c: c.update(sliding_window_non_causal="no"),
         r'config.json: sliding_window_non_causal must be true or false, got "no"'),
        (layouts.speculators_config, lambda c: c.update(aux_hidden_state_layer_ids=[1, "2", 3]),
         r'config.json: aux_hidden_state_layer_ids\[1\] must be an integer, got "2"'),
        (layouts.zlab_config, _set_zlab_layer_id,
         r'config.json: dflash_config.target_layer_ids\[1\] must be an integer, got "1"'),
    ],
    ids=["flag_a_string", "speculators_layer_id_a_string", "zlab_layer_id_a_string"],
)
def test_the_engine_views_read_config_json_through_its_layouts_schema(write, edit, error):
    """served_architectures judges a config.json by its layout's declared schema (layouts.CONFIG_SCHEMAS), as
    read_export_config does: a string where a flag belongs is refused by name, never read as true."""
    config = write(make_config(), "t")
    edit(config)
    with pytest.raises(ExportError, match=error):
        served_architectures(config)


@pytest.mark.parametrize("name", ["../model-00001-of-00002.safetensors", "", "sub/model.safetensors"])
def test_an_index_naming_a_shard_outside_the_export_is_refused_naming_the_field(spec_export, name):
    shard(spec_export)
    with open(os.path.join(spec_export, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"fc.weight": name}}, f)
    with pytest.raises(ExportError, match=r"model.safetensors.index.json: weight_map.fc.weight must be a shard's file "
                                          r"name \(shards are file names inside the export directory\), got "):
        load_exported(spec_export)

@pytest.mark.parametrize("ids, tapped", [([1, 2, 3, 4], 4), ([1, 2], 2)], ids=["more_ids_than_fc", "fewer_ids_than_fc"])
def test_an_fc_that_does_not_cover_the_layer_ids_is_refused_never_sliced(spec_export, ids, tapped):
    edit_config(spec_export, lambda c: c.update(aux_hidden_state_layer_ids=ids))
    with pytest.raises(ExportError, match=rf"fc\.weight is \[32, 96\]: 3 tapped layers .* lists {tapped} target layer"):
        load_exported(spec_export)


def test_every_shape_is_checked_and_named(spec_export):
    edit_config(spec_export, lambda c: c["transformer_layer_config"].update(num_key_value_heads=1))
    with pytest.raises(ExportError, match=r"layers\.0\.self_attn\.k_proj\.weight is \[16, 32\], the config makes it "
                                          r"\[8, 32\]"):
        load_exported(spec_export)


def test_non_finite_weights_are_refused(spec_export):
    path = os.path.join(spec_export, "model.safetensors")
    weights = load_file(path)
    weights["norm.weight"][3] = float("nan")
    save_file(weights, path)
    with pytest.raises(ExportError, match=r"norm\.weight holds non-finite values"):
        load_exported(spec_export)


def test_unreadable_files_are_refused_by_name(spec_export):
    weights = os.path.join(spec_export, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ExportError, match="model.safetensors is not a readable safetensors file"):
        load_exported(spec_export)
    os.remove(weights)
    with pytest.raises(ExportError, match="has neither model.safetensors nor model.safetensors.index.json"):
        load_exported(spec_export)
    for text, error in [("{ not json", "config.json is not valid JSON"), ("[1, 2]", "holds a list, not a JSON object"),
                        ('{"model_type": "qwen3"}', "is not a DFlash drafter")]:
        with open(os.path.join(spec_export, "config.json"), "w") as f:
            f.write(text)
        with pytest.raises(ExportError, match=error):
            load_exported(spec_export)


def test_eval_names_what_is_wrong_with_a_broken_export(spec_export):
    """dflash-fast eval --drafter DIR: a directory with a config.json is an export (checkpoints have none)."""
    from dflash_fast.evaluate.evaluate import load_drafter

    with open(os.path.join(spec_export, "config.json"), "w") as f:
        f.write("{ not json")
    with pytest.raises(ExportError, match="config.json is not valid JSON"):
        load_drafter(spec_export, "never-read-target")


def shard(export_dir, weight_map=None):
    """Split model.safetensors into two shards and an index, as HF's save_pretrained does for large drafters."""
    path = os.path.join(export_dir, "model.safetensors")
    weights = load_file(path)
    os.remove(path)
    names = sorted(weights)
    files = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
             "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in files.items():
        save_file({k: weights[k] for k in keys}, os.path.join(export_dir, file))
    if weight_map is None:
        weight_map = {k: file for file, keys in files.items() for k in keys}
    with open(os.path.join(export_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return weights


def test_a_sharded_export_loads_and_a_bad_index_is_refused(spec_export):
    whole = load_exported(spec_export)
    shard(spec_export)
    back = load_exported(spec_export)
    for (name, p), (_, q) in zip(whole.named_parameters(), back.named_parameters()):
        assert torch.equal(p, q), name
    index = os.path.join(spec_export, "model.safetensors.index.json")
    cases = [
        ({"metadata": {}}, r"weight_map is missing \(it must be an object\)"),
        ({"weight_map": {"fc.weight": "../model-00001-of-00002.safetensors"}}, "shards are file names inside"),
        ({"weight_map": {"fc.weight": "model-00001-of-00002.safetensors"}}, "and its shards disagree"),
    ]
    for content, error in cases:
        with open(index, "w") as f:
            json.dump(content, f)
        with pytest.raises(ExportError, match=error):
            load_exported(spec_export)


def test_an_export_the_engines_would_read_differently_is_refused(spec_export):
    """Exports written before the fix have sliding layers without use_sliding_window: speculators reads no window,
    vLLM (raw attributes, no Qwen3Config) reads it; loading one would train a drafter neither engine serves."""

    def old_style_sliding(c):
        layer = c["transformer_layer_config"]
        layer.update(layer_types=["full_attention", "sliding_attention"], sliding_window=5)
        layer.pop("use_sliding_window")
        c["sliding_window_non_causal"] = True

    edit_config(spec_export, old_style_sliding)
    with pytest.raises(ExportError, match=r"layer_windows: trained \[None, None\], vllm serves \[None, 5\]"):
        load_exported(spec_export)


def test_a_draft_vocabulary_smaller_than_the_target_is_refused(spec_export):
    edit_config(spec_export, lambda c: c.update(draft_vocab_size=64))
    with pytest.raises(ExportError, match="draft_vocab_size 64 of a 96-token vocabulary needs a draft-to-target"):
        load_exported(spec_export)


def test_speculators_verifier_tensors_saved_beside_the_drafter_are_ignored(spec_export):
    path = os.path.join(spec_export, "model.safetensors")
    weights = load_file(path)
    save_file(dict(weights, **{"embed_tokens.weight": torch.zeros(V, H), "lm_head.weight": torch.zeros(V, H)}), path)
    assert load_exported(spec_export).config == make_drafter().config


# ---------------------------------------------------------------- crash safety


def test_an_earlier_export_is_replaced_and_a_failed_one_leaves_it_untouched(tmp_path, monkeypatch):
    out = str(tmp_path / "export")
    export_drafter(make_drafter(seed=0), out, "t", torch.float32)
    export_drafter(make_drafter(seed=1), out, "t", torch.float32)
    assert torch.equal(load_file(out + "/model.safetensors")["fc.weight"], make_drafter(seed=1).fc.weight.detach())
    before = open(out + "/model.safetensors", "rb").read()

    def fail(*_args):
        raise ExportError("simulated gate failure")

    monkeypatch.setattr(export, "gate", fail)
    with pytest.raises(ExportError, match="simulated"):
        export_drafter(make_drafter(seed=2), out, "t", torch.float32)
    assert open(out + "/model.safetensors", "rb").read() == before
    assert sorted(os.listdir(tmp_path)) == ["export"]


def test_a_directory_that_is_not_an_export_is_never_replaced(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ExportError, match="exists and is not an export"):
        export_drafter(make_drafter(), str(tmp_path / "run"), "t", torch.float32)
    assert os.listdir(tmp_path / "run") == ["metrics.jsonl"]


def test_the_temporary_directory_of_a_killed_export_is_cleaned_up(tmp_path):
    (tmp_path / "export.tmp-abc123").mkdir()
    (tmp_path / "export.tmp-abc123" / "model.safetensors").write_bytes(b"torn")
    export_drafter(make_drafter(), str(tmp_path / "export"), "t", torch.float32)
    assert sorted(os.listdir(tmp_path)) == ["export"]


# ---------------------------------------------------------------- RoPE against the real transformers class


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 128},
        {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 128,
         "partial_rotary_factor": 0.5},
        {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0},
        {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 128},
        {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
    ],
    ids=["default", "yarn", "yarn_partial", "linear", "llama3", "dynamic"],
)
def test_drafter_rope_equals_qwen3_rotary_embedding_of_the_exported_config(rope, tmp_path):
    """speculators' DFlashDraftModel builds Qwen3RotaryEmbedding from the reloaded transformer_layer_config."""
    d = make_drafter(head_dim=16, rope_parameters=rope)
    export_drafter(d, str(tmp_path / "export"), "t", torch.float32)
    layer = json.loads((tmp_path / "export" / "config.json").read_text())["transformer_layer_config"]
    hf = Qwen3RotaryEmbedding(Qwen3Config(**layer))
    positions = torch.arange(300)[None]
    cos, sin = hf(torch.zeros((), dtype=torch.float32), positions)
    ours_cos, ours_sin = Rope(d.config).cos_sin(positions, torch.float32)
    assert torch.allclose(ours_cos[..., 0, :], cos, atol=1e-6) and torch.allclose(ours_sin[..., 0, :], sin, atol=1e-6)


def test_partial_rotary_rotates_the_first_channels_as_vllm_does():
    """vLLM's get_rope (neox style) with partial_rotary_factor f rotates the first int(f * head_dim) channels of
    each head with rotate-half and passes the rest through; HF's Qwen3RotaryEmbedding ignores f for rope_type
    default (checked here too), which is why docs/export.md names vLLM for partial-rotary drafters."""
    cfg = make_config(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 5e5,
                                                    "partial_rotary_factor": 0.5})
    rope = Rope(cfg)
    x = torch.randn(1, 7, 2, 16)
    positions = torch.arange(7)[None]
    got = rope.rotate(x, *rope.cos_sin(positions, torch.float32))
    rot = 8
    inv_freq = 1.0 / (5e5 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    angle = positions[0, :, None].float() * inv_freq  # [7, rot/2]
    cos, sin = angle.cos()[None, :, None], angle.sin()[None, :, None]
    x1, x2 = x[..., : rot // 2], x[..., rot // 2 : rot]
    want = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rot:]], dim=-1)
    assert torch.allclose(got, want, atol=1e-6)
    hf = Qwen3RotaryEmbedding(Qwen3Config(hidden_size=H, num_attention_heads=4, head_dim=16,
                                          rope_parameters=dict(cfg.rope_parameters)))
    assert hf.inv_freq.numel() == 8, "HF's Qwen3 default RoPE rotates every channel whatever the factor"


# ---------------------------------------------------------------- the engines' rules, pinned


def test_vllm_gives_every_layer_of_a_speculators_export_one_in_block_rule():
    """qwen3_dflash.py, _dflash_layer_causal: is_causal, else dflash_config.causal, else causal on sliding layers;
    for a speculators export algos.py's update_dflash always sets dflash_config.causal = not
    sliding_window_non_causal (default true), a rule for every layer, full ones included."""
    cfg = make_config(layer_types=["full", "sliding"], sliding_window=5)
    config = layouts.speculators_config(cfg, "t")
    assert config["transformer_layer_config"]["is_causal"] is False and config["sliding_window_non_causal"] is True
    assert served_architectures(config)["vllm"]["layer_causal"] == [False, False]
    config["transformer_layer_config"].pop("is_causal")
    assert served_architectures(config)["vllm"]["layer_causal"] == [False, False]
    config["sliding_window_non_causal"] = False
    assert served_architectures(config)["vllm"]["layer_causal"] == [True, True], "the full layer too"
    config.pop("sliding_window_non_causal")
    assert served_architectures(config)["vllm"]["layer_causal"] == [False, False], "vLLM's default: non-causal"
    # the zlab layout is read natively (no update_dflash): sliding layers causal, full layers bidirectional
    zlab = layouts.zlab_config(cfg, "t")
    zlab.pop("is_causal")
    assert served_architectures(zlab)["vllm"]["layer_causal"] == [False, True]


def test_a_full_layer_drafter_is_exported_bidirectional_for_every_vllm_rule(tmp_path):
    """The default drafter (full layers only) once said sliding_window_non_causal=false, which vLLM's
    update_dflash turns into causal=true for every layer: without is_causal (vLLM before it read that key) the
    whole drafter would have served causal."""
    config = written_config(export_drafter(make_drafter(), str(tmp_path / "e"), "t", torch.float32))
    assert config["sliding_window_non_causal"] is True
    config["transformer_layer_config"].pop("is_causal")
    assert served_architectures(config)["vllm"]["layer_causal"] == [False, False]


def test_vllm_reads_the_block_from_the_proposal_method():
    config = layouts.speculators_config(make_config(), "t")
    config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 7
    served = served_architectures(config)
    assert served["vllm"]["block_size"] == 8 and served["speculators"]["block_size"] == B


def test_speculators_takes_head_dim_from_qwen3config_defaults():
    """Qwen3Config's head_dim default is 128, vLLM's is hidden / heads: an export without head_dim is refused."""
    config = layouts.speculators_config(make_config(), "t")
    config["transformer_layer_config"].pop("head_dim")
    served = served_architectures(config)
    assert served["speculators"]["head_dim"] == 128 and served["vllm"]["head_dim"] == H // 4
    with pytest.raises(ExportError, match="head_dim: trained 128, vllm serves 8"):
        engines.config_from_export(config)


# ---------------------------------------------------------------- the trainer: its export, model.init_from

TARGET_V = 384  # test_trainer's tiny target vocabulary; 383 is free for the mask token


@pytest.fixture(scope="module")
def trained(tiny):  # noqa: F811 (the fixture imported above)
    """test_trainer's tiny target and store (layer ids 1, 2) and a 2-step run that ends with its export."""
    from dflash_fast.train.config import load_config
    from dflash_fast.train.trainer import train

    run = str(tiny.root / "export_run")
    tiny.run, tiny.result = run, train(load_config(TINY_YAML, settings(tiny, run, schedule__steps=2)))
    return tiny


def trainer_for(store, out, **extra):
    from dflash_fast.train import trainer
    from dflash_fast.train.config import load_config
    from dflash_fast.train.distributed import init_distributed

    return trainer.Trainer(load_config(TINY_YAML, settings(store, out, **extra)), *init_distributed())


def zlab_like_drafter_for_the_tiny_target(directory, layer_ids=(1, 2), hidden=32, vocab=TARGET_V):
    """A z-lab layout drafter (sliding layer causal, full layer bidirectional) sized for the tiny target."""
    cfg = DrafterConfig(
        hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
        vocab_size=vocab, layer_ids=list(layer_ids), target_num_layers=4, target_hidden_size=hidden,
        mask_token_id=vocab - 1, num_layers=2, block_size=B, layer_types=["sliding", "full"], sliding_window=8,
        causal_in_block=[True, False],
    )
    torch.manual_seed(5)
    d = DFlashDrafter(cfg)
    d.reset_parameters(std=0.1)
    config = layouts.zlab_config(cfg, "somewhere/else")
    config.pop("dflash_fast")  # a published drafter carries no dflash-fast metadata
    os.makedirs(directory, exist_ok=True)
    save_file({n: p.detach() for n, p in d.named_parameters()}, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return d


def test_the_trainers_export_passes_the_gate_and_loads_back_with_the_checkpoints_weights(trained):
    from dflash_fast.train.checkpoint import load_drafter_for_export

    assert trained.result["export"] == os.path.join(trained.run, "export")
    drafter, verifier = load_drafter_for_export(trained.run)
    back = load_exported(trained.result["export"], trained.target)
    assert back.config == drafter.config and verifier == trained.target
    for (name, p), (_, q) in zip(drafter.named_parameters(), back.named_parameters()):
        assert torch.equal(p, q), name


def test_dflash_fast_export_writes_the_zlab_layout_from_a_checkpoint(trained, capsys):
    from dflash_fast.cli import main

    out = os.path.join(trained.root, "zlab")
    assert main(["export", "--checkpoint", trained.run, "--out", out, "--format", "zlab", "--dtype", "fp32"]) == 0
    assert "zlab format; read back as sglang and vllm read it" in capsys.readouterr().out
    config = written_config(out)
    assert config["dflash_config"]["target_layer_ids"] == [1, 2] and config["num_target_layers"] == 4
    assert load_exported(out, trained.target).config == load_exported(trained.result["export"], trained.target).config


def test_init_from_starts_training_from_a_published_drafter(trained):
    from dflash_fast.evaluate.evaluate import load_drafter

    published = zlab_like_drafter_for_the_tiny_target(os.path.join(trained.root, "published"))
    # settings() sets model.num_layers=1, so the export's 2 is given (a value set in the config must agree)
    t = trainer_for(trained, os.path.join(trained.root, "from_published"),
                    model__init_from=os.path.join(trained.root, "published"), model__num_layers=2)
    assert t.engine.module.config.causal_in_block == [True, False]
    for (name, p), (_, q) in zip(published.named_parameters(), t.engine.module.named_parameters()):
        assert torch.equal(p, q.detach().cpu()), name
    result = t.run()
    # the fine-tuned drafter, gated: causal sliding + bidirectional full layers serve only from the zlab layout
    exported = load_exported(result["export"], trained.target)
    assert exported.config == t.engine.module.config
    assert layouts.export_format(written_config(result["export"])) == "zlab"
    evaluated = load_drafter(os.path.join(trained.root, "published"), trained.target)
    assert architecture(evaluated.config) == architecture(published.config), "eval reads the z-lab layout too"


def test_init_from_refuses_a_drafter_that_does_not_match_the_store(trained):
    from dflash_fast.train.config import ConfigError
    from dflash_fast.train.model import StoreMismatch

    zlab_like_drafter_for_the_tiny_target(os.path.join(trained.root, "ids03"), layer_ids=(0, 3))
    with pytest.raises(StoreMismatch, match=r"model.init_from=.*ids03: (.|\n)*layer ids: the store has \[1, 2\], "
                                            r"the drafter has \[0, 3\]"):
        trainer_for(trained, os.path.join(trained.root, "x1"), model__init_from=os.path.join(trained.root, "ids03"),
                    model__num_layers=2)
    zlab_like_drafter_for_the_tiny_target(os.path.join(trained.root, "wide"), hidden=48)
    with pytest.raises(StoreMismatch, match=r"target hidden size: the store has 32, the drafter has 48"):
        trainer_for(trained, os.path.join(trained.root, "x2"), model__init_from=os.path.join(trained.root, "wide"),
                    model__num_layers=2)
    zlab_like_drafter_for_the_tiny_target(os.path.join(trained.root, "small_vocab"), vocab=380)
    with pytest.raises(StoreMismatch, match=r"vocabulary size: the store has 384, the drafter has 380"):
        trainer_for(trained, os.path.join(trained.root, "x4"),
                    model__init_from=os.path.join(trained.root, "small_vocab"), model__num_layers=2,
                    model__mask_token_id=379)
    zlab_like_drafter_for_the_tiny_target(os.path.join(trained.root, "two_layers"))
    with pytest.raises(ConfigError, match=r"fixes the drafter: model.num_layers=1 but the export has 2"):
        trainer_for(trained, os.path.join(trained.root, "x3"),
                    model__init_from=os.path.join(trained.root, "two_layers"))


def test_load_exported_refuses_a_drafter_made_for_another_target(trained):
    """evaluate.load_drafter(DIR, target) loads through here: a drafter for a deeper target would tap layers
    the target does not have, or read the wrong ones."""
    deeper = os.path.join(trained.root, "for_a_deeper_target")
    zlab_like_drafter_for_the_tiny_target(deeper)
    edit_config(deeper, lambda c: c.update(num_target_layers=6))
    assert load_exported(deeper).config.target_num_layers == 6
    with pytest.raises(ExportError, match=r"decoder layers: the drafter was made for 6, the target has 4"):
        load_exported(deeper, trained.target)
    other_vocab = os.path.join(trained.root, "for_another_vocabulary")
    zlab_like_drafter_for_the_tiny_target(other_vocab, vocab=380)
    with pytest.raises(ExportError, match=r"vocabulary size: the drafter was made for 380, the target has 384"):
        load_exported(other_vocab, trained.target)


def test_the_trainer_refuses_before_step_1_a_drafter_its_export_cannot_serve(trained):
    from dflash_fast.train.config import ConfigError

    refused = (r"layer_causal: trained \[True\], speculators serves \[False\](.|\n)*"
               r"layer_causal: trained \[True\], sglang serves \[False\](.|\n)*export=false")
    with pytest.raises(ConfigError, match=refused):
        trainer_for(trained, os.path.join(trained.root, "causal"), model__causal_in_block=True)
    t = trainer_for(trained, os.path.join(trained.root, "causal_no_export"), model__causal_in_block=True, export=False)
    assert t.engine.module.config.causal_in_block == [True]
