"""Export a trained drafter for serving, prove that it serves as it trained, and load exported drafters back.

    OUT/config.json         one of the two layouts below (written atomically)
    OUT/model.safetensors   trainable weights only, under the names both layouts use: fc, hidden_norm,
                            layers.{i}.{self_attn,mlp,...}, norm (embedding, lm_head and final norm are the target's)

    speculators  read by vLLM and vllm-project/speculators: {speculators_model_type: "dflash",
                 transformer_layer_config: a Qwen3 config, aux_hidden_state_layer_ids = ids + 1, block_size, ...};
                 a DSpark drafter (SPEC §8) as speculators_model_type "dspark" (vLLM's `dspark` method) with
                 sample_from_anchor, markov_rank, markov_head_type, enable_confidence_head,
                 confidence_head_with_markov and the heads' weights markov_head.markov_w1 / markov_w2,
                 confidence_head.proj
    zlab         read by SGLang and vLLM, the layout of z-lab's published drafters: a flat Qwen3 config with
                 architectures ["DFlashDraftModel"], block_size, num_target_layers,
                 dflash_config {target_layer_ids = ids, mask_token_id, block_size}

Layer ids: ours name HF `hidden_states[id + 1]` (SPEC §1), and so do z-lab's target_layer_ids; speculators numbers
the same tensors one higher.

The gate. An export is written into a temporary directory beside OUT and read back the way every engine that
loads its format reads it: `served_architectures` builds transformers' Qwen3Config from the file, then applies
that engine's own rules (which window, which in-block mask, which RoPE, which layer ids; each rule cites the
engine's file and function). Every engine's architecture is compared field by field with the trained drafter's,
a drafter rebuilt from the written files is compared with the trained one on a random batch (fp32 logits, eager
ops, `GATE_TOLERANCE`), and only a passing export is renamed to OUT. `load_exported` reads an export through
the same engine rules and refuses one the engines would read differently.
"""
import argparse
import glob
import json
import os
import shutil
import tempfile
from typing import Callable, Dict, List, Optional

import torch

from dflash_fast import ops
from dflash_fast.checkpoint import load_drafter_for_export
from dflash_fast.drafter import (
    DFlashDrafter,
    DrafterConfig,
    check_tensors,
    load_frozen_tensors,
    read_tensors,
    stderr_line,
    value_problems,
)
from dflash_fast.eager import WINDOW_RULES
from dflash_fast.errors import (
    BOOL,
    INT,
    OBJECT,
    STR,
    WEIGHTS_INDEX_SCHEMA,
    ListOf,
    Nullable,
    Obj,
    check_schema,
    is_int,
    read_mapping,
)
from dflash_fast.store import check_layer_ids, default_layer_ids, torch_dtype, write_json_atomic

FORMATS = ("speculators", "zlab")
ENGINES = {"speculators": ("speculators", "vllm"), "zlab": ("sglang", "vllm")}
HF_LAYER_TYPES = {"full": "full_attention", "sliding": "sliding_attention"}
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# What a serving engine builds, per drafter layer where it is per layer; `architecture` and every engine view
# return these keys.
ARCHITECTURE = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "target_hidden_size",
    "layer_ids",
    "mask_token_id",
    "block_size",
    "rms_norm_eps",
    "rope_parameters",
    "max_position_embeddings",
    "num_layers",
    "layer_windows",
    "layer_causal",
    "window_from",  # where a sliding window ends (eager.WINDOW_RULES); None without a sliding layer
    # DSpark (SPEC §8); DFlash drafters: false, 0, "vanilla", false, true
    "sample_from_anchor",
    "markov_rank",
    "markov_head_type",
    "confidence_head",
    "confidence_head_with_markov",
)
# The DSpark fields of a DFlash drafter (DrafterConfig's defaults): what a view of a DFlash-only layout serves.
DFLASH_ONLY = dict(sample_from_anchor=False, markov_rank=0, markov_head_type="vanilla", confidence_head=False,
                   confidence_head_with_markov=True)
# Tensors other tools save next to the drafter that come from the target here: speculators' DFlashDraftModel
# saves embed_tokens / lm_head (src/speculators/models/dflash/core.py, _keys_to_ignore_on_load_missing).
FROZEN_TENSORS = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight")
# The gate's logits check: a drafter rebuilt from the export against the trained one with its weights rounded to
# the export dtype, both in fp32 on the eager ops.
GATE_TOLERANCE = dict(rtol=1e-5, atol=1e-5)
# Fields where an engine that serves another rule than the drafter trained with still runs it, at a lower acceptance:
# export warns of them (naming the field) instead of refusing, and reads them back from our own metadata.
SERVING_RULES = ("window_from",)
# Why an engine reads a field differently, and the fix, for the mismatches that have a known cause.
HINTS = {
    "window_from": "vLLM, SGLang and z-lab end each query's sliding window at its own position, speculators 0.9.0 "
    "trains SPEC §4's window at the anchor: the drafter runs, but accepts fewer tokens than it would with the rule "
    "it trained with; train with model.window_from=query to serve in vLLM or SGLang (docs/vllm.md)",
    "layer_causal": "speculators serves full-attention layers bidirectional in the block and all sliding layers "
    "one rule, vLLM gives every layer of a speculators export one rule (sliding_window_non_causal), SGLang and vLLM "
    "serve a zlab export's full layers bidirectional and sliding layers causal (set model.causal_in_block to match, "
    "or export the other format)",
    "rope_parameters": "SGLang's DFlash rotates all head_dim channels (get_rope(rotary_dim=head_dim)): export "
    "a drafter with partial_rotary_factor 1 to the zlab format, or use the speculators format (vLLM applies it)",
    "markov_head_type": "vLLM's DSpark (qwen3_dspark.py, DSparkMarkovHead) serves the vanilla Markov head only: "
    "train model.markov_head_type=vanilla to serve with vLLM",
    "markov_rank": "the z-lab layout (SGLang's and vLLM's dflash method) has no DSpark heads: export a DSpark drafter "
    "in the speculators format",
    "target_hidden_size": "speculators and SGLang size fc from the drafter's hidden_size: the drafter's hidden size "
    "must equal the target's",
}


class ExportError(ValueError):
    """An export cannot be written, or an export on disk cannot be read, as a serving engine would serve it; the
    message names the field, the engine and the fix."""


# ---------------------------------------------------------------- writing the two layouts


def qwen3_layer(cfg: DrafterConfig) -> Dict:
    """The Qwen3 config both layouts carry (speculators: transformer_layer_config; zlab: the top level)."""
    sliding = "sliding" in cfg.layer_types
    rope = dict(cfg.rope_parameters)
    layer = {
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "rope_parameters": rope,
        "rope_theta": rope["rope_theta"],  # transformers 4 readers and z-lab's MLX loader read these two
        "layer_types": [HF_LAYER_TYPES[k] for k in cfg.layer_types],
        # Qwen3Config sets sliding_window = None unless use_sliding_window is true: without it the sliding layers
        # are served as full attention (issue 12).
        "use_sliding_window": sliding,
        "sliding_window": cfg.sliding_window if sliding else None,
    }
    if rope.get("rope_type", "default") != "default":
        layer["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if not any(cfg.causal_in_block):
        # vLLM makes sliding layers causal in the block unless the config says is_causal (qwen3_dflash.py,
        # _dflash_layer_causal); our all-bidirectional drafters say so.
        layer["is_causal"] = False
    return layer


def _metadata(cfg: DrafterConfig, verifier: str) -> Dict:
    """What serving does not need but loading back does (the layouts have no field for them)."""
    return {
        "verifier": verifier,
        "target_num_layers": cfg.target_num_layers,
        "target_model_type": cfg.target_model_type,
        "window_from": cfg.window_from,
    }


def is_dspark(cfg: DrafterConfig) -> bool:
    """The drafter has a DSpark field other than DFlash's (SPEC §8): exported as speculators' `dspark` type."""
    return any(getattr(cfg, key) != value for key, value in DFLASH_ONLY.items())


def speculators_config(cfg: DrafterConfig, verifier: str) -> Dict:
    """config.json of the speculators layout (DSpark fields as speculators' DSparkSpeculatorConfig names them)."""
    # vLLM turns this flag into one in-block rule for EVERY layer (update_dflash: dflash_config.causal = not
    # sliding_window_non_causal): true unless a sliding layer is causal, so full-layer drafters stay bidirectional.
    causal_sliding = any(c for c, kind in zip(cfg.causal_in_block, cfg.layer_types) if kind == "sliding")
    algorithm = "dspark" if is_dspark(cfg) else "dflash"
    dspark = {}
    if algorithm == "dspark":
        dspark = {
            "markov_rank": cfg.markov_rank,
            "markov_head_type": cfg.markov_head_type,
            "enable_confidence_head": cfg.confidence_head,
            "confidence_head_with_markov": cfg.confidence_head_with_markov,
        }
    return {
        "speculators_model_type": algorithm,
        "architectures": ["DSparkDraftModel" if algorithm == "dspark" else "DFlashDraftModel"],
        "transformer_layer_config": qwen3_layer(cfg),
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.layer_ids],
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "draft_vocab_size": cfg.vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "sliding_window_non_causal": not causal_sliding,
        "sample_from_anchor": cfg.sample_from_anchor,  # false: slot 0 is the given token, never drafted (SPEC §5)
        **dspark,
        "speculators_config": {
            "algorithm": algorithm,
            # speculators (_build_base_config_kwargs): block_size tokens with sample_from_anchor, else block_size - 1
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": cfg.block_size - 1 + int(cfg.sample_from_anchor)}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": []},
        },
        "dflash_fast": _metadata(cfg, verifier),
    }


def zlab_config(cfg: DrafterConfig, verifier: str) -> Dict:
    """config.json of the z-lab layout (no auto_map: the z-lab Transformers backend's dflash.py is not shipped)."""
    return {
        **qwen3_layer(cfg),
        "architectures": ["DFlashDraftModel"],
        "block_size": cfg.block_size,
        "num_target_layers": cfg.target_num_layers,
        "dflash_config": {
            "target_layer_ids": list(cfg.layer_ids),
            "mask_token_id": cfg.mask_token_id,
            "block_size": cfg.block_size,
        },
        "dflash_fast": _metadata(cfg, verifier),
    }


def format_config(cfg: DrafterConfig, fmt: str, verifier: str) -> Dict:
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}: choose one of {FORMATS}")
    return speculators_config(cfg, verifier) if fmt == "speculators" else zlab_config(cfg, verifier)


def export_format(config: Dict) -> Optional[str]:
    """'speculators', 'zlab', or None for a config.json that is neither."""
    if config.get("speculators_model_type") in ("dflash", "dspark"):
        return "speculators"
    if "DFlashDraftModel" in (config.get("architectures") or []) and isinstance(config.get("dflash_config"), dict):
        return "zlab"
    return None


# ---------------------------------------------------------------- how each engine reads an export


def architecture(cfg: DrafterConfig) -> Dict:
    """The trained drafter in the terms of `ARCHITECTURE`."""
    return {
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "layer_ids": list(cfg.layer_ids),
        "mask_token_id": cfg.mask_token_id,
        "block_size": cfg.block_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": normal_rope(cfg.rope_parameters),
        "max_position_embeddings": cfg.max_position_embeddings,
        "num_layers": cfg.num_layers,
        "layer_windows": [cfg.sliding_window if k == "sliding" else None for k in cfg.layer_types],
        "layer_causal": list(cfg.causal_in_block),
        "window_from": cfg.window_from if "sliding" in cfg.layer_types else None,
        **_dspark_fields(*(getattr(cfg, key) for key in DFLASH_ONLY)),
    }


def _dspark_fields(sample_from_anchor, markov_rank, markov_head_type, confidence_head, with_markov) -> Dict:
    """The DSpark fields of `ARCHITECTURE`; without a confidence head its input is moot and reads as true."""
    return dict(sample_from_anchor=sample_from_anchor, markov_rank=markov_rank, markov_head_type=markov_head_type,
                confidence_head=confidence_head, confidence_head_with_markov=with_markov or not confidence_head)


def normal_rope(params: Dict) -> Dict:
    """RoPE parameters as the drafter's Rope reads them: rope_type (not the legacy `type`), no factor-1 partial."""
    rope = dict(params)
    legacy = rope.pop("type", None)
    rope.setdefault("rope_type", legacy or "default")
    if rope.get("partial_rotary_factor", 1.0) == 1.0:
        rope.pop("partial_rotary_factor", None)
    return rope


def _need(config: Dict, key: str, where: str):
    if key not in config or config[key] is None:
        raise ExportError(f"config.json has no {key!r} ({where} needs it)")
    return config[key]


def _int_list(value, key: str) -> List[int]:
    """A layer-id list read from config.json, refused naming the key when it is not a list of integers."""
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise ExportError(f"config.json: {key}={value!r} is not a list of integer layer ids")
    return value


def _hf_config(layer: Dict, where: str):
    """transformers' config class for the layer config's model_type, built from it (Qwen3Config for ours)."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        # speculators: DFlashSpeculatorConfig.validate_transformer_config (config.py) does exactly this.
        return AutoConfig.for_model(layer.get("model_type", "qwen3")).__class__(**layer)
    except (TypeError, ValueError, StrictDataclassError) as e:
        raise ExportError(f"{where}: transformers cannot build the drafter's config from it: {e}") from None


def _common(hf, where: str, head_dim) -> Dict:
    """Sizes every engine takes straight from the (transformers) layer config, checked for what we cannot build."""
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ExportError(f"{where}: hidden_act={hf.hidden_act!r}; dflash-fast drafters use silu (SwiGLU) MLPs")
    if getattr(hf, "attention_bias", False):
        raise ExportError(f"{where}: attention_bias=true; dflash-fast drafters have no attention biases")
    return {
        "hidden_size": hf.hidden_size,
        "num_attention_heads": hf.num_attention_heads,
        "num_key_value_heads": getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        "head_dim": head_dim,
        "intermediate_size": hf.intermediate_size,
        "rms_norm_eps": hf.rms_norm_eps,
        "max_position_embeddings": hf.max_position_embeddings,
        "num_layers": hf.num_hidden_layers,
    }


def _check_vocab(draft_vocab: int, vocab: int, where: str) -> None:
    if draft_vocab != vocab:
        raise ExportError(
            f"{where}: draft_vocab_size {draft_vocab} of a {vocab}-token vocabulary needs a draft-to-target token "
            f"mapping; dflash-fast drafters draft the target's whole vocabulary"
        )


def _layer_types(hf, where: str) -> List[str]:
    types = list(getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers)
    if len(types) != hf.num_hidden_layers or set(types) - set(HF_LAYER_TYPES.values()):
        raise ExportError(f"{where}: layer_types={types} is not one of {sorted(HF_LAYER_TYPES.values())} per layer")
    return types


def _speculators_view(config: Dict) -> Dict:
    """vllm-project/speculators, src/speculators/models/dflash/: DFlashSpeculatorConfig builds Qwen3Config from
    transformer_layer_config; DFlashDraftModel.__init__ takes sliding_window and layer_types from it, sizes fc as
    len(aux_hidden_state_layer_ids) * hidden_size and reads hidden_states[id] for each aux id; attention.py
    (create_anchor_block_mask_mod) keeps full layers bidirectional and makes sliding layers causal in the block
    unless sliding_window_non_causal; rotary from Qwen3RotaryEmbedding of that config (utils.flatten_rope_parameters
    picks the sliding variant of per-layer-type parameters, which our drafter cannot express)."""
    where = "speculators (DFlashSpeculatorConfig / DFlashDraftModel)"
    hf = _hf_config(_need(config, "transformer_layer_config", where), where)
    aux = _int_list(_need(config, "aux_hidden_state_layer_ids", where), "aux_hidden_state_layer_ids")
    dspark = config.get("speculators_model_type") == "dspark"
    if config.get("sample_from_anchor", False) and not dspark:
        raise ExportError(f"{where}: a DFlash drafter with sample_from_anchor=true: dflash-fast trains that as DSpark")
    rope = hf.rope_parameters
    if "rope_type" not in rope and "sliding_attention" in rope:
        raise ExportError(f"{where}: per-layer-type rope_parameters; dflash-fast drafters use one RoPE")
    types = _layer_types(hf, where)
    non_causal = bool(config.get("sliding_window_non_causal", False))
    _check_vocab(config.get("draft_vocab_size", 32000), hf.vocab_size, where)  # DFlashSpeculatorConfig's default
    return {
        **_common(hf, where, hf.head_dim),
        "vocab_size": hf.vocab_size,
        "target_hidden_size": hf.hidden_size,
        "layer_ids": [i - 1 for i in aux],
        "mask_token_id": config.get("mask_token_id"),
        "block_size": config.get("block_size", 8),  # DFlashSpeculatorConfig's default
        "rope_parameters": normal_rope(rope),
        "layer_windows": [hf.sliding_window if t == "sliding_attention" else None for t in types],
        "layer_causal": [t == "sliding_attention" and not non_causal for t in types],
        "window_from": "anchor" if "sliding_attention" in types else None,  # kv_base_pos >= q_anchor - sliding_window
        **(_speculators_dspark(config) if dspark else DFLASH_ONLY),
    }


def _speculators_dspark(config: Dict) -> Dict:
    """speculators' DSparkSpeculatorConfig (models/dspark/config.py) defaults: sample_from_anchor true, markov_rank
    256, vanilla, enable_confidence_head true, confidence_head_with_markov true; DSparkDraftModel builds no Markov
    head at markov_rank 0."""
    return _dspark_fields(
        bool(config.get("sample_from_anchor", True)),
        config.get("markov_rank", 256),
        config.get("markov_head_type", "vanilla"),
        bool(config.get("enable_confidence_head", True)),
        bool(config.get("confidence_head_with_markov", True)),
    )


def _vllm_dspark(config: Dict, where: str) -> Dict:
    """vLLM's dspark method: algos.py update_dspark surfaces markov_rank, markov_head_type, enable_confidence_head,
    confidence_head_with_markov and dspark_bonus_anchor = not sample_from_anchor (default true); qwen3_dspark.py
    always builds a vanilla DSparkMarkovHead of markov_rank (W1[prev] -> W2, no gate or recurrence), the confidence
    head only with enable_confidence_head (default false), reading [hidden, W1[prev]] only with
    confidence_head_with_markov (default false)."""
    rank = config.get("markov_rank")
    if not is_int(rank) or rank < 1:
        raise ExportError(f"{where}: markov_rank={rank!r}; vLLM's DSpark builds a Markov head of that rank (>= 1)")
    return _dspark_fields(
        bool(config.get("sample_from_anchor", True)),
        rank,
        "vanilla",
        bool(config.get("enable_confidence_head", False)),
        bool(config.get("confidence_head_with_markov", False)),
    )


def _vllm_layers(hf, where: str):
    """vLLM, vllm/model_executor/models/qwen3_dflash.py: _resolve_layer_attention (sliding per layer_types, or
    every layer with dflash_config.use_swa and no sliding layer; the window from dflash_config.swa_window_size or
    sliding_window, an error when neither) and _dflash_layer_causal (is_causal, else dflash_config.causal, else
    causal exactly on the layer_types' sliding layers). The window is Attention's per_layer_sliding_window, a
    window of each query's own position (window_from "query")."""
    dflash = getattr(hf, "dflash_config", None) or {}
    types = getattr(hf, "layer_types", None)
    _layer_types(hf, where)
    use_swa = dflash.get("use_swa", False)
    if types is None or (use_swa and "sliding_attention" not in types):
        sliding = [use_swa] * hf.num_hidden_layers
    else:
        sliding = [t == "sliding_attention" for t in types]
    window = dflash.get("swa_window_size", getattr(hf, "sliding_window", None))
    if any(sliding) and window is None:
        raise ExportError(f"{where}: a sliding layer has no window (vLLM raises: set sliding_window)")
    override = getattr(hf, "is_causal", None)
    if override is None:
        override = dflash.get("causal")
    default = [bool(types) and t == "sliding_attention" for t in types or [None] * hf.num_hidden_layers]
    causal = [bool(override)] * hf.num_hidden_layers if override is not None else default
    return [window if s else None for s in sliding], causal


def _vllm_rope(hf) -> Dict:
    """vLLM's DFlash layer calls get_rope(head_dim, rope_parameters=config.rope_parameters), which applies
    partial_rotary_factor; set_default_rope_theta fills a missing rope_theta with 1e6."""
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    if "rope_type" not in rope and getattr(hf, "rope_scaling", None):
        rope.update(hf.rope_scaling)
    rope.setdefault("rope_theta", getattr(hf, "rope_theta", None) or 1_000_000.0)
    return normal_rope(rope)


# Attributes vLLM's DFlash model reads from the draft config without a default (qwen3_dflash.py).
VLLM_READS = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "num_hidden_layers",
    "rms_norm_eps",
    "max_position_embeddings",
    "vocab_size",
)


def _vllm_speculators_view(config: Dict) -> Dict:
    """vLLM reading the speculators layout: vllm/transformers_utils/configs/speculators/base.py
    (extract_transformers_pre_trained_config: the attributes are transformer_layer_config's keys as written, no
    Qwen3Config) and algos.py (update_dflash: dflash_config = {mask_token_id, target_layer_ids = aux ids - 1,
    causal = not sliding_window_non_causal (default true)}, draft_vocab_size, target_hidden_size); causal is a
    global override in qwen3_dflash.py (_dflash_layer_causal), so every layer gets one in-block rule. The block is
    the proposal method's speculative_tokens + 1."""
    from types import SimpleNamespace

    where = "vLLM (speculators config adapter, qwen3_dflash.py)"
    layer = dict(_need(config, "transformer_layer_config", where))
    for key in VLLM_READS:
        _need(layer, key, where + ": transformer_layer_config")
    aux = _int_list(_need(config, "aux_hidden_state_layer_ids", where), "aux_hidden_state_layer_ids")
    layer["dflash_config"] = {
        "mask_token_id": _need(config, "mask_token_id", where),
        "target_layer_ids": [i - 1 for i in aux],
        "causal": not config.get("sliding_window_non_causal", True),
    }
    hf = SimpleNamespace(**layer)
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    tokens = methods[0].get("speculative_tokens")
    if tokens is None:
        raise ExportError(f"config.json has no speculators_config.proposal_methods[0].speculative_tokens ({where})")
    windows, causal = _vllm_layers(hf, where)
    _check_vocab(config.get("draft_vocab_size") or hf.vocab_size, hf.vocab_size, where)
    dspark = _vllm_dspark(config, where) if config.get("speculators_model_type") == "dspark" else DFLASH_ONLY
    return {
        **_common(hf, where, getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads),
        "vocab_size": hf.vocab_size,
        "target_hidden_size": config.get("target_hidden_size") or hf.hidden_size,
        "layer_ids": layer["dflash_config"]["target_layer_ids"],
        "mask_token_id": config["mask_token_id"],
        # the anchor is a bonus token (one more slot than drafted tokens) unless it samples from the anchor
        "block_size": tokens + 1 - int(dspark["sample_from_anchor"]),
        "rope_parameters": _vllm_rope(hf),
        "layer_windows": windows,
        "layer_causal": causal,
        "window_from": "query" if any(w is not None for w in windows) else None,
        **dspark,
    }


def _zlab_ids(config: Dict, hf, where: str):
    """z-lab's layer ids, mask token and block: dflash_config first, then the top level (SGLang,
    python/sglang/srt/speculative/dflash_utils.py, parse_dflash_draft_config); layer ids default to z-lab's
    build_target_layer_ids(num_target_layers, num_hidden_layers) (dflash/model.py)."""
    dflash = config["dflash_config"]
    ids = dflash.get("target_layer_ids", config.get("target_layer_ids"))
    if ids is not None:
        _int_list(ids, "dflash_config.target_layer_ids")
    else:
        num_target = dflash.get("num_target_layers", config.get("num_target_layers"))
        if num_target is None:
            raise ExportError(f"config.json has neither dflash_config.target_layer_ids nor num_target_layers ({where})")
        try:
            ids = default_layer_ids(num_target, hf.num_hidden_layers)
        except ValueError as e:
            raise ExportError(f"config.json has no dflash_config.target_layer_ids, and z-lab's default: {e}") from None
    mask = dflash.get("mask_token_id", config.get("mask_token_id"))
    if mask is None:
        raise ExportError(f"config.json has no dflash_config.mask_token_id ({where} would look up a <|MASK|> token)")
    return list(ids), mask, dflash.get("block_size", config.get("block_size"))


def _sglang_view(config: Dict) -> Dict:
    """SGLang, python/sglang/srt/models/dflash.py: AutoConfig (Qwen3Config) of config.json;
    _get_dflash_layer_attention_params serves full layers ENCODER_ONLY (bidirectional) and sliding layers DECODER
    (causal) with the window of get_dflash_attention_sliding_window_size (an error when sliding_window is None);
    fc = len(target_layer_ids) * hidden_size; get_rope(head_dim, rotary_dim=head_dim, rope_parameters): no partial
    rotary; block_size defaults to 16."""
    where = "SGLang (DFlashDraftModel, parse_dflash_draft_config)"
    hf = _hf_config(config, where)
    ids, mask, block = _zlab_ids(config, hf, where)
    types = _layer_types(hf, where)
    if "sliding_attention" in types and hf.sliding_window is None:
        raise ExportError(f"{where}: sliding layers and no sliding_window (SGLang raises; Qwen3Config drops the "
                          f"window unless use_sliding_window is true)")
    rope = normal_rope(hf.rope_parameters)
    rope.pop("partial_rotary_factor", None)
    return {
        **_common(hf, where, hf.head_dim),
        "vocab_size": hf.vocab_size,
        "target_hidden_size": hf.hidden_size,
        "layer_ids": ids,
        "mask_token_id": mask,
        "block_size": block if block is not None else 16,
        "rope_parameters": rope,
        "layer_windows": [hf.sliding_window if t == "sliding_attention" else None for t in types],
        "layer_causal": [t == "sliding_attention" for t in types],
        "window_from": "query" if "sliding_attention" in types else None,  # RadixAttention window_left = W - 1
        **DFLASH_ONLY,
    }


def _vllm_zlab_view(config: Dict) -> Dict:
    """vLLM reading the z-lab layout (`--speculative-config '{"method": "dflash", "model": DIR}'`): AutoConfig
    (Qwen3Config) of config.json and qwen3_dflash.py's rules (see _vllm_layers, _vllm_rope); the block is the
    command line's num_speculative_tokens + 1, which docs/export.md tells you to set to block_size - 1."""
    where = "vLLM (qwen3_dflash.py)"
    hf = _hf_config(config, where)
    ids, mask, block = _zlab_ids(config, hf, where)
    windows, causal = _vllm_layers(hf, where)
    return {
        **_common(hf, where, getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads),
        "vocab_size": hf.vocab_size,
        "target_hidden_size": getattr(hf, "target_hidden_size", None) or hf.hidden_size,
        "layer_ids": ids,
        "mask_token_id": mask,
        "block_size": block,
        "rope_parameters": _vllm_rope(hf),
        "layer_windows": windows,
        "layer_causal": causal,
        "window_from": "query" if any(w is not None for w in windows) else None,
        **DFLASH_ONLY,
    }


VIEWS = {
    ("speculators", "speculators"): _speculators_view,
    ("speculators", "vllm"): _vllm_speculators_view,
    ("zlab", "sglang"): _sglang_view,
    ("zlab", "vllm"): _vllm_zlab_view,
}


def served_architectures(config: Dict) -> Dict[str, Dict]:
    """{engine: architecture as that engine builds it} for a config.json of either layout."""
    fmt = export_format(config)
    if fmt is None:
        raise ExportError(
            "config.json is not a DFlash drafter: it has neither speculators_model_type 'dflash' or 'dspark' "
            "(speculators layout) "
            "nor architectures ['DFlashDraftModel'] with a dflash_config (z-lab layout)"
        )
    served = {}
    for engine in ENGINES[fmt]:
        try:
            served[engine] = VIEWS[fmt, engine](config)
        except (TypeError, AttributeError) as e:  # a hand-edited key of the wrong JSON type (a list for an object)
            raise ExportError(f"config.json cannot be read as {engine} reads it, a key holds the wrong kind of "
                              f"value: {e}") from None
    return served


def _check_values(arch: Dict) -> None:
    """Refuse an architecture read from a file whose fields hold the wrong kind of value or a meaningless one (a
    hand-edited `"block_size": "16"` or `"rope_theta": -1` would otherwise build a drafter that fails far from the
    cause): the drafter's own value rules (value_problems), each sliding window included."""
    windows = dict.fromkeys(w for w in arch["layer_windows"] if w is not None)
    read = {k: v for k, v in arch.items() if k not in SERVING_RULES}  # the engines' rules, not read from the file
    problems = value_problems(read) + [p for w in windows for p in value_problems({"sliding_window": w})]
    if problems:
        raise ExportError("config.json:\n  - " + "\n  - ".join(problems))


def mismatches(expected: Dict, served: Dict[str, Dict], serving_rules: bool = False) -> List[str]:
    """One line per field where an engine's architecture differs from `expected`, with the known cause: the fields
    an engine must build as trained, or with serving_rules the SERVING_RULES."""
    lines = []
    for engine, arch in served.items():
        for field in ARCHITECTURE:
            if (field in SERVING_RULES) != serving_rules:
                continue
            if arch[field] != expected[field]:
                hint = f" ({HINTS[field]})" if field in HINTS else ""
                lines.append(f"{field}: trained {expected[field]!r}, {engine} serves {arch[field]!r}{hint}")
    return lines


def check_servable(cfg: DrafterConfig, fmt: str) -> None:
    """Refuse, before anything is written, a drafter that the engines of `fmt` would serve differently."""
    problems = mismatches(architecture(cfg), served_architectures(format_config(cfg, fmt, verifier="")))
    if problems:
        raise ExportError(f"the {fmt} format cannot serve this drafter as it trained:\n  - " + "\n  - ".join(problems))


def servable_format(cfg: DrafterConfig) -> str:
    """The first of FORMATS whose engines serve `cfg` as it trained (speculators, then zlab: z-lab's pattern of
    causal sliding and bidirectional full layers only serves from the zlab layout); refused naming each format's
    problems when neither does."""
    problems = []
    for fmt in FORMATS:
        try:
            check_servable(cfg, fmt)
            return fmt
        except ExportError as e:
            problems.append(str(e))
    raise ExportError("\n".join(problems))


def config_from_architecture(arch: Dict, target_num_layers: int, target_model_type: str = "",
                             window_from: str = "anchor") -> DrafterConfig:
    windows = {w for w in arch["layer_windows"] if w is not None}
    if len(windows) > 1:
        raise ExportError(f"the layers use different sliding windows {sorted(windows)}; dflash-fast drafters use one")
    kept = {k: arch[k] for k in ARCHITECTURE if k not in ("layer_windows", "layer_causal", *SERVING_RULES)}
    return DrafterConfig(
        **kept,
        layer_types=["sliding" if w is not None else "full" for w in arch["layer_windows"]],
        sliding_window=windows.pop() if windows else None,
        window_from=window_from,
        causal_in_block=arch["layer_causal"],
        target_num_layers=target_num_layers,
        target_model_type=target_model_type,
    )


def config_from_export(config: Dict, target_config=None) -> DrafterConfig:
    """The DrafterConfig of an export of either layout (ours or another tool's), as its engines serve it; refused
    when they would serve it differently. The window rule is the one it trained with (our metadata's
    window_from; SPEC §4's "anchor" for an export without it), whichever rule an engine serves."""
    served = served_architectures(config)
    engines = list(served)
    first = served[engines[0]]
    for arch in served.values():  # before comparing: NaN differs from itself
        _check_values(arch)
    problems = [line for line in mismatches(first, {e: served[e] for e in engines[1:]})]
    if problems:
        raise ExportError(
            f"{engines[0]} and {' / '.join(engines[1:])} would serve this export differently (the values before "
            f"'serves' are {engines[0]}'s):\n  - " + "\n  - ".join(problems)
        )
    ours = config.get("dflash_fast") or {}
    if not isinstance(ours, dict):
        raise ExportError(f"config.json: dflash_fast={ours!r} is not an object")
    target_layers = ours.get("target_num_layers") or config.get("num_target_layers")
    if target_layers is not None and (not is_int(target_layers) or target_layers < 1):
        raise ExportError(f"config.json: the target's layer count {target_layers!r} is not an integer >= 1")
    model_type = ours.get("target_model_type", "")
    window_from = ours.get("window_from", "anchor")
    if value_problems({"window_from": window_from}):
        raise ExportError(f"config.json: dflash_fast.window_from={window_from!r} is not one of {WINDOW_RULES}")
    if target_config is not None:
        tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        target_layers, model_type = target_layers or tc.num_hidden_layers, model_type or tc.model_type
    ids = first["layer_ids"]
    target_layers = target_layers or 1 + max((i for i in ids if isinstance(i, int)), default=0)
    try:
        check_layer_ids(ids, target_layers)
    except ValueError as e:
        raise ExportError(f"the export's target layer ids {ids} (our convention): {e}") from None
    try:
        return config_from_architecture(first, target_layers, model_type, window_from)
    except (TypeError, ValueError) as e:
        raise ExportError(f"the export's drafter is not one dflash-fast can build: {e}") from None


def check_made_for(cfg: DrafterConfig, target_config, where: str) -> None:
    """Refuse a drafter made for another target than `target_config`'s, naming both values (before any tensor
    is read: a mismatch would otherwise surface deep in a matmul or as a wrong hidden state)."""
    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    problems = [
        f"{what}: the drafter was made for {theirs}, the target has {ours}"
        for what, theirs, ours in (
            ("vocabulary size", cfg.vocab_size, tc.vocab_size),
            ("hidden size", cfg.target_hidden_size, tc.hidden_size),
            ("decoder layers", cfg.target_num_layers, tc.num_hidden_layers),
        )
        if theirs != ours
    ]
    if problems:
        raise ExportError(f"{where} does not fit this target (give the target it was trained on):\n  - "
                          + "\n  - ".join(problems))


# ---------------------------------------------------------------- weights


def trainable_state_dict(drafter: DFlashDrafter) -> Dict[str, torch.Tensor]:
    """Module names already follow both layouts' (`fc.weight`, `layers.{i}.self_attn.q_proj.weight`, ...)."""
    return {name: p.detach().contiguous() for name, p in drafter.named_parameters()}


def read_weights(
    export_dir: str, cfg: DrafterConfig, warn: Callable[[str], None] = stderr_line
) -> Dict[str, torch.Tensor]:
    """The drafter tensors of model.safetensors, or of the shards model.safetensors.index.json lists (never
    unpickled), checked against `cfg` by check_tensors: headers first (nothing loaded when the config implies more
    parameters than the files hold), then the values. FROZEN_TENSORS stored beside them are not loaded."""
    from safetensors import SafetensorError, safe_open

    index = os.path.join(export_dir, WEIGHTS_INDEX)
    if os.path.exists(index):
        weight_map = _read_json(index, WEIGHTS_INDEX_SCHEMA)["weight_map"]
        if not weight_map:
            raise ExportError(f"{index} has no weight_map object ({{tensor name: shard file}})")
        names = sorted(set(weight_map.values()), key=str)
        for name in names:
            if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
                raise ExportError(f"{index} lists the shard {name!r}: shards are file names inside {export_dir}")
        files = [os.path.join(export_dir, name) for name in names]
        stored = set()
        for path in files:
            try:
                with safe_open(path, "pt") as f:
                    stored |= set(f.keys())
            except (SafetensorError, OSError) as e:
                raise ExportError(f"{path} is not a readable safetensors file: {e}") from None
        misplaced = sorted(stored ^ set(weight_map))
        if misplaced:
            raise ExportError(f"{index} and its shards disagree: {misplaced[:6]} are in one but not the other")
        where = f"{index} (against its config.json)"
    elif os.path.exists(os.path.join(export_dir, WEIGHTS)):
        files = [os.path.join(export_dir, WEIGHTS)]
        where = f"{files[0]} (against its config.json)"
    else:
        raise ExportError(f"{export_dir} has neither {WEIGHTS} nor {WEIGHTS_INDEX}")
    return read_tensors(files, cfg, ExportError, unused=FROZEN_TENSORS, where=where, warn=warn)


# The JSON shape of the keys each layout's readers take from config.json (errors.check_schema); the sizes inside
# transformer_layer_config / the z-lab top level are transformers' (_hf_config) and _check_values' to judge.
_OPT_INT, _OPT_BOOL = Nullable(INT), Nullable(BOOL)
_DFLASH_KEYS = {"target_layer_ids": ListOf(INT), "num_target_layers": _OPT_INT, "mask_token_id": _OPT_INT,
                "block_size": _OPT_INT}
CONFIG_SCHEMAS = {
    "speculators": Obj(
        {"transformer_layer_config": OBJECT, "aux_hidden_state_layer_ids": ListOf(INT)},
        optional={"speculators_config": Nullable(Obj({}, optional={
                      "proposal_methods": Nullable(ListOf(Obj({}, optional={"speculative_tokens": _OPT_INT})))})),
                  "mask_token_id": _OPT_INT, "block_size": _OPT_INT, "draft_vocab_size": _OPT_INT,
                  "target_hidden_size": _OPT_INT, "sample_from_anchor": _OPT_BOOL,
                  "sliding_window_non_causal": _OPT_BOOL, "dflash_fast": Nullable(OBJECT)},
    ),
    "zlab": Obj(
        {"architectures": ListOf(STR),
         "dflash_config": Obj({}, optional={**_DFLASH_KEYS, "use_swa": _OPT_BOOL, "swa_window_size": _OPT_INT,
                                            "causal": _OPT_BOOL})},
        optional={**_DFLASH_KEYS, "layer_types": Nullable(ListOf(STR)), "dflash_fast": Nullable(OBJECT)},
    ),
}


def _read_json(path: str, schema: Optional[Obj] = None) -> Dict:
    return read_mapping(path, json.load, json.JSONDecodeError, ExportError, "JSON", "a JSON object", schema=schema)


def read_export_config(export_dir: str) -> Dict:
    """config.json of an export directory, refused when it is neither layout or a key its layout's readers take
    holds the wrong kind of JSON value (the error names the key's path)."""
    path = os.path.join(export_dir, "config.json")
    config = _read_json(path)
    fmt = export_format(config)
    if fmt is None:
        served_architectures(config)  # raises, naming both layouts
    return check_schema(config, CONFIG_SCHEMAS[fmt], path, ExportError)


def load_exported(
    export_dir: str,
    target_path: Optional[str] = None,
    norm_kind: Optional[str] = None,
    frozen_dtype: torch.dtype = torch.float32,
) -> DFlashDrafter:
    """A drafter from an export of either layout (ours or a published one), as its engines serve it. With
    target_path the frozen tensors are the target's (`norm_kind`, `frozen_dtype`: see load_frozen_tensors)."""
    config = read_export_config(export_dir)
    target_config = None
    if target_path is not None:
        from transformers import AutoConfig

        target_config = AutoConfig.from_pretrained(target_path)
    cfg = config_from_export(config, target_config)
    if target_config is not None:
        check_made_for(cfg, target_config, f"the drafter in {export_dir}")
    weights = read_weights(export_dir, cfg)
    drafter = DFlashDrafter(cfg, frozen_dtype)
    drafter.load_trainable(weights)
    if target_path is not None:
        drafter.set_frozen(**load_frozen_tensors(target_path, frozen_dtype, norm_kind=norm_kind))
    return drafter


# ---------------------------------------------------------------- the gate and the crash-safe write


def gate_batch(cfg: DrafterConfig, seed: int = 0) -> Dict[str, torch.Tensor]:
    """One random row that reaches past a sliding window when the window is short (long windows are covered by
    the field comparison): hidden [1, T, K, H_t], four anchors, one document."""
    g = torch.Generator().manual_seed(seed)
    window = min(cfg.sliding_window or 0, 128)
    t = max(3 * cfg.block_size, window + 2 * cfg.block_size)
    anchors = torch.linspace(1, t - 2, 4).long()[None]
    return {
        "hidden": torch.randn(1, t, cfg.num_tapped, cfg.target_hidden_size, generator=g),
        "input_ids": torch.randint(0, cfg.vocab_size, (1, t), generator=g),
        "position_ids": torch.arange(t)[None],
        "document_ids": torch.zeros(1, t, dtype=torch.long),
        "loss_mask": torch.ones(1, t, dtype=torch.bool),
        "anchors": anchors,
        "anchor_valid": torch.ones_like(anchors, dtype=torch.bool),
    }


def gate_logits(drafter: DFlashDrafter, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """fp32 logits of every block slot [1, A*B, V] on the eager ops (the SPEC's reference semantics); a DSpark
    drafter's with the Markov bias, and its confidence logit as one more column [1, A*B, V + 1]."""
    with torch.no_grad(), ops.backend("eager"):
        logits, confidence = drafter.block_logits(batch)
    return logits if confidence is None else torch.cat([logits, confidence[..., None]], dim=-1)


def gate(export_dir: str, trained: DrafterConfig, tensors: Dict[str, torch.Tensor]) -> None:
    """Read `export_dir` back as its engines do and compare with the trained drafter (`tensors`: its weights as
    written); raises ExportError naming the first field, tensor or logit that differs."""
    config = read_export_config(export_dir)
    problems = mismatches(architecture(trained), served_architectures(config))
    if problems:
        raise ExportError("the written export would be served differently from the trained drafter:\n  - "
                          + "\n  - ".join(problems))
    g = torch.Generator().manual_seed(1)
    frozen = dict(  # random but shared: both drafters see the same embedding and lm_head, held once
        embed_tokens=torch.randn(trained.vocab_size, trained.hidden_size, generator=g),
        lm_head=torch.randn(trained.vocab_size, trained.hidden_size, generator=g),
        target_norm=1 + 0.1 * torch.randn(trained.hidden_size, generator=g),
    )
    check_tensors(trained, tensors, "the weights to export (in the export dtype)", ExportError)
    reference = DFlashDrafter(trained, frozen_dtype=torch.bfloat16)
    reference.load_trainable(tensors)
    served_config = config_from_export(config)
    served_weights = read_weights(export_dir, served_config, warn=lambda _: None)  # warned of as `tensors`
    served = DFlashDrafter(served_config, frozen_dtype=torch.bfloat16)
    served.load_trainable(served_weights)
    for drafter in (reference, served):
        for name, value in frozen.items():
            setattr(drafter, name, value)
    batch = gate_batch(trained)
    want, got = gate_logits(reference, batch), gate_logits(served, batch)
    if not torch.isfinite(want).all() or not torch.allclose(got, want, **GATE_TOLERANCE):
        worst = (got - want).abs().nan_to_num(float("inf")).max().item()
        raise ExportError(
            f"a drafter rebuilt from {export_dir} gives other logits than the trained one on a random batch "
            f"(max |difference| {worst:.3g}, tolerance {GATE_TOLERANCE}; non-finite trained logits: "
            f"{not torch.isfinite(want).all()})"
        )


def _is_replaceable(path: str) -> bool:
    """An earlier export (or an empty directory) may be replaced; anything else is refused, never deleted."""
    if not os.path.isdir(path):
        return False
    names = set(os.listdir(path))
    return not names or ("config.json" in names and names <= {"config.json", WEIGHTS, WEIGHTS_INDEX})


def export_drafter(
    drafter: DFlashDrafter,
    out_dir: str,
    verifier: str,
    dtype: Optional[torch.dtype] = torch.bfloat16,
    state_dict: Optional[Dict[str, torch.Tensor]] = None,
    fmt: str = "speculators",
    warn: Callable[[str], None] = stderr_line,
) -> str:
    """Write OUT/config.json and OUT/model.safetensors in `fmt`, gated: written into a temporary directory beside
    OUT, read back as the serving engines read it, and renamed to OUT only when it passes; nothing is left behind
    on failure. `state_dict` overrides the module's own weights (e.g. gathered from ZeRO-3). An engine that serves
    another SERVING_RULES rule than the drafter trained with is warned of (one line each). Returns out_dir."""
    from safetensors.torch import save_file

    cfg = drafter.config
    check_servable(cfg, fmt)
    rules = mismatches(architecture(cfg), served_architectures(format_config(cfg, fmt, verifier="")), True)
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and not _is_replaceable(out_dir):
        raise ExportError(f"{out_dir} exists and is not an export: choose another output directory")
    tensors = state_dict if state_dict is not None else trainable_state_dict(drafter)
    tensors = {k: (v.to(dtype) if dtype is not None else v).cpu().contiguous() for k, v in tensors.items()}
    parent, name = os.path.split(out_dir)
    os.makedirs(parent, exist_ok=True)
    for stale in glob.glob(os.path.join(parent, glob.escape(name) + ".tmp-*")):  # left by a killed export
        shutil.rmtree(stale, ignore_errors=True)
    tmp = tempfile.mkdtemp(prefix=name + ".tmp-", dir=parent)
    try:
        save_file(tensors, os.path.join(tmp, WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(tmp, WEIGHTS), "rb") as f:
            os.fsync(f.fileno())
        write_json_atomic(os.path.join(tmp, "config.json"), format_config(cfg, fmt, verifier))
        gate(tmp, cfg, tensors)
        old = None
        if os.path.exists(out_dir):
            old = tempfile.mkdtemp(prefix=name + ".old-", dir=parent)
            os.replace(out_dir, os.path.join(old, "export"))
        os.replace(tmp, out_dir)
        if old is not None:
            shutil.rmtree(old)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for line in rules:
        warn(f"warning: {out_dir} serves at a lower acceptance than it trained for: model.{line}")
    return out_dir


# ---------------------------------------------------------------- `dflash-fast export`


def add_arguments(parser):
    parser.add_argument(
        "--checkpoint", required=True, help="a trainer run directory, its checkpoints/ directory or one checkpoint"
    )
    parser.add_argument("--out", required=True, help="export directory (replaced if it holds an earlier export)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument(
        "--format",
        default="speculators",
        choices=FORMATS,
        help="speculators: vLLM and vllm-project/speculators; zlab: SGLang (and vLLM), z-lab's published layout",
    )


def run(args: argparse.Namespace):
    drafter, verifier = load_drafter_for_export(args.checkpoint)
    export_drafter(drafter, args.out, verifier, torch_dtype(args.dtype), fmt=args.format)
    print(
        f"exported {sum(p.numel() for p in drafter.parameters()):,} parameters to {args.out} ({args.format} format; "
        f"read back as {' and '.join(ENGINES[args.format])} read it: same architecture and logits)"
    )
