"""DFlash2's export (spec.md §9, docs/export.md): speculators' `dflash2` type and z-lab's DFlash2DraftModel layout, the
convolutions' and the selector's tensors under the names vLLM's qwen3_dflash2.py, SGLang and z-lab load, through the
export gate (read back as each engine reads it, rebuilt, logits and candidate scores compared). The real vLLM
serving a trained DFlash2 export is tests/test_vllm.py's."""
import json

import pytest
import torch
from test_dflash2 import ORACLE_BATCH, dflash2_drafter
from test_drafter import random_batch

from dflash_fast.drafter.dflash2 import head_shapes
from dflash_fast.serve import export
from dflash_fast.serve.architecture import architecture
from dflash_fast.serve.engines import config_from_export, served_architectures
from dflash_fast.serve.families.dflash2 import DFLASH2_FIELDS
from dflash_fast.serve.layouts import ExportError

# Each DFlash2 tensor and a likely misnaming: z-lab's nn.Embedding codebooks are `.weight` in its module but not in
# its checkpoints (its from_pretrained's key_mapping adds it), SGLang's and vLLM's projection modules' own names.
RENAMED = {
    "layers.0.attention_conv.base_kernel": "layers.0.attention_conv.weight",
    "layers.0.mlp_conv.kernel_projection.weight": "layers.0.mlp_conv.kernel_proj.weight",
    "candidate_selector.predecessor_codebook": "candidate_selector.predecessor_codebook.weight",
    "candidate_selector.successor_codebook": "candidate_selector.successor_codebook.weight",
    "candidate_selector.hidden_projection.weight": "candidate_selector.hidden_proj.weight",
}


def written(out):
    with open(f"{out}/config.json") as f:
        return json.load(f)


@pytest.mark.parametrize("fmt", ["speculators", "zlab"])
def test_a_dflash2_export_passes_the_gate_and_loads_back_as_the_trained_drafter(tmp_path, fmt):
    d = dflash2_drafter()
    out = export.export_drafter(d, str(tmp_path / "export"), "tiny-target", torch.float32, fmt=fmt)
    config = written(out)
    fields = {key: getattr(d.config, key) for key in DFLASH2_FIELDS}
    assert config["architectures"] == ["DFlash2DraftModel"]
    if fmt == "speculators":  # speculators' DFlash2SpeculatorConfig: the fields at the top level
        assert config["speculators_model_type"] == "dflash2" == config["speculators_config"]["algorithm"]
        assert {key: config[key] for key in DFLASH2_FIELDS} == fields
    else:  # z-lab, SGLang, vLLM: dflash_config
        assert {key: config["dflash_config"][key] for key in DFLASH2_FIELDS} == fields
    weights = export.read_weights(out, d.config)
    assert set(head_shapes(d.config)) <= set(weights) and set(RENAMED) <= set(weights)
    assert all(arch == architecture(d.config) for arch in served_architectures(config).values())
    back = export.load_exported(out)
    back.set_frozen(d.embed_tokens, d.lm_head, d.target_norm)
    batch = random_batch(t=20, **ORACLE_BATCH)
    torch.testing.assert_close(back.block_logits(batch)[0], d.block_logits(batch)[0])
    assert torch.equal(back.propose(batch["hidden"][0, :9], 5), d.propose(batch["hidden"][0, :9], 5))


def saving(monkeypatch, edit):
    """export_drafter's model.safetensors written through `edit(tensors) -> tensors`."""
    real_save = __import__("safetensors.torch", fromlist=["save_file"]).save_file
    monkeypatch.setattr("safetensors.torch.save_file",
                        lambda tensors, path, metadata=None: real_save(edit(dict(tensors)), path, metadata=metadata))


@pytest.mark.parametrize("name", list(RENAMED))
def test_a_renamed_or_missing_dflash2_tensor_is_refused_naming_it(tmp_path, monkeypatch, name):
    def rename(tensors):
        tensors[RENAMED[name]] = tensors.pop(name)
        return tensors

    for edit in (rename, lambda tensors: {k: v for k, v in tensors.items() if k != name}):
        saving(monkeypatch, edit)
        with pytest.raises(ExportError, match=r"missing \['" + name.replace(".", r"\.")):
            export.export_drafter(dflash2_drafter(), str(tmp_path / "export"), "t", torch.float32)
        monkeypatch.undo()
        assert not (tmp_path / "export").exists()


@pytest.mark.parametrize("name, what", [
    ("candidate_selector.predecessor_codebook", "candidate selector scores"),  # leaves the unary logits alone
    ("candidate_selector.hidden_projection.weight", "candidate selector scores"),
    ("layers.0.attention_conv.base_kernel", "logits"),
    ("layers.0.mlp_conv.kernel_projection.weight", "logits"),
])
def test_a_corrupted_dflash2_tensor_fails_the_gate_naming_it(tmp_path, monkeypatch, name, what):
    saving(monkeypatch, lambda tensors: {k: v + 0.5 if k == name else v for k, v in tensors.items()})
    with pytest.raises(ExportError, match=f"other {what} .*read back other than written: \\['{name}'\\]"):
        export.export_drafter(dflash2_drafter(), str(tmp_path / "export"), "t", torch.float32)


@pytest.mark.parametrize("fmt, edit, served", [
    ("speculators", {"conv_kernel_size": 3}, "conv_kernel_size: trained 2, speculators serves 3"),
    ("speculators", {"conv_group_size": 4}, "conv_group_size: trained 8, speculators serves 4"),
    ("speculators", {"selector_top_k": 4}, "selector_top_k: trained 5, speculators serves 4"),
    ("speculators", {"selector_rank": ...}, r"vLLM \(speculators config adapter, qwen3_dflash2.py\).*"
                                            r"selector_rank=None"),  # absent: speculators defaults it, vLLM raises
    ("speculators", {"speculators_model_type": "dflash"}, "conv_kernel_size: trained 2, speculators serves 0"),
    ("zlab", {"architectures": ["DFlashDraftModel"]}, "selector_rank: trained 8, sglang serves 0"),
    ("zlab", {"dflash_config.selector_rank": 4}, "selector_rank: trained 8, sglang serves 4"),
    ("zlab", {"dflash_config.conv_group_size": None}, r"dflash_config: conv_group_size=None"),
])
def test_a_wrong_dflash2_config_field_is_refused_naming_it(tmp_path, monkeypatch, fmt, edit, served):
    real = export.format_config

    def wrong(cfg, fmt, verifier):
        config = real(cfg, fmt, verifier)
        for key, value in edit.items():
            holder = config["dflash_config"] if key.startswith("dflash_config.") else config
            holder[key.removeprefix("dflash_config.")] = value
            if value is ...:
                del holder[key.removeprefix("dflash_config.")]
        return config

    monkeypatch.setattr(export, "format_config", wrong)
    with pytest.raises(ExportError, match=served):
        export.export_drafter(dflash2_drafter(), str(tmp_path / "export"), "t", torch.float32, fmt=fmt)


@pytest.mark.parametrize("keys, why", [
    (dict(conv_kernel_size=0), "conv_kernel_size=0"),
    (dict(selector_rank=0), "selector_rank=0"),
    (dict(sample_from_anchor=True), "sample_from_anchor=true"),
])
@pytest.mark.parametrize("fmt", ["speculators", "zlab"])
def test_a_dflash2_drafter_no_engine_builds_is_refused_before_writing(tmp_path, keys, why, fmt):
    from test_drafter import random_drafter

    base = dict(conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=5)
    d = random_drafter(0, **{**base, **keys})
    with pytest.raises(ExportError, match=f"cannot serve this DFlash2 drafter.*\n.*{why}"):
        export.export_drafter(d, str(tmp_path / "export"), "t", torch.float32, fmt=fmt)
    assert not (tmp_path / "export").exists()


def test_a_zlab_dflash_config_with_a_convolution_but_no_dflash2_architecture_is_refused():
    """SGLang builds the convolutions of any DFlash draft whose dflash_config sets conv_kernel_size, vLLM only for
    DFlash2DraftModel: the two would serve different drafters."""
    from dflash_fast.serve.layouts import format_config

    d = dflash2_drafter()
    config = format_config(d.config, "zlab", "t")
    config["architectures"] = ["DFlashDraftModel"]
    with pytest.raises(ExportError, match="conv_kernel_size: .*vllm serves 0"):
        config_from_export(config)


def test_the_model_card_of_a_dflash2_export_names_the_family_and_its_sizes():
    from dflash_fast.serve.model_card import model_card

    card = model_card(dflash2_drafter().config, "t", "speculators", "/export")
    assert "# DFlash2 (DFlash backbone with dynamic convolutions and a candidate selector) drafter" in card
    assert "| DFlash2 | 2-tap convolutions in groups of 8, a selector of rank 8 over the unary top 5" in card
