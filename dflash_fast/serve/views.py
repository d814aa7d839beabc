"""How each serving engine reads an export, modelled on the CPU: from a config.json of either layout
(`dflash_fast.serve.layouts`) transformers' Qwen3Config, then that engine's own rules (which window, which in-block
mask, which RoPE, which layer ids; each rule cites the engine's file and function), giving the drafter it would build
in the terms of `architecture.ARCHITECTURE`. `VIEWS`: each format's engines and their view.

    speculators layout   speculators (`_speculators_view`), vLLM (`_vllm_speculators_view`)
    zlab layout          SGLang (`_sglang_view`), vLLM (`_vllm_zlab_view`)

Each view reads the backbone here, and the fields of the family the config.json names as that family's serving home
reads them (`families.read_families`: dflash_fast/serve/families/<family>.py, its `read` for the view); no view names
a family.
"""
import json
from typing import Dict, List

from dflash_fast.serve.architecture import normal_rope
from dflash_fast.serve.families import read_families
from dflash_fast.serve.families.base import VIEW_SGLANG, VIEW_SPECULATORS, VIEW_VLLM_SPECULATORS, VIEW_VLLM_ZLAB
from dflash_fast.serve.layouts import HF_LAYER_TYPES, ExportError
from dflash_fast.store.layer_ids import default_layer_ids


def _need(config: Dict, key: str, where: str):
    if key not in config or config[key] is None:
        raise ExportError(f"config.json has no {key!r} ({where} needs it)")
    return config[key]


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
    aux = _need(config, "aux_hidden_state_layer_ids", where)
    family = read_families(VIEW_SPECULATORS, config, hf, where)
    if config.get("sample_from_anchor", False) and not family["sample_from_anchor"]:
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
        **family,
    }


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
    the proposal method's speculative_tokens + 1. A `dflash2` type (update_dflash2: method dflash, architectures
    DFlash2DraftModel, the four DFlash2 fields copied into dflash_config when set) is served by qwen3_dflash2.py,
    which reads each as int(dflash_config[key]), no default."""
    from types import SimpleNamespace

    where = "vLLM (speculators config adapter, qwen3_dflash.py)"
    layer = dict(_need(config, "transformer_layer_config", where))
    for key in VLLM_READS:
        _need(layer, key, where + ": transformer_layer_config")
    aux = _need(config, "aux_hidden_state_layer_ids", where)
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
    family = read_families(VIEW_VLLM_SPECULATORS, config, hf, where)
    return {
        **_common(hf, where, getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads),
        "vocab_size": hf.vocab_size,
        "target_hidden_size": config.get("target_hidden_size") or hf.hidden_size,
        "layer_ids": layer["dflash_config"]["target_layer_ids"],
        "mask_token_id": config["mask_token_id"],
        # the anchor is a bonus token (one more slot than drafted tokens) unless it samples from the anchor
        "block_size": tokens + 1 - int(family["sample_from_anchor"]),
        "rope_parameters": _vllm_rope(hf),
        "layer_windows": windows,
        "layer_causal": causal,
        "window_from": "query" if any(w is not None for w in windows) else None,
        **family,
    }


def _zlab_ids(config: Dict, hf, where: str):
    """z-lab's layer ids, mask token and block: dflash_config first, then the top level (SGLang,
    python/sglang/srt/speculative/dflash_utils.py, parse_dflash_draft_config); layer ids default to z-lab's
    build_target_layer_ids(num_target_layers, num_hidden_layers) (dflash/model.py)."""
    dflash = config["dflash_config"]
    ids = dflash.get("target_layer_ids", config.get("target_layer_ids"))
    if ids is None:
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


# z-lab's DFlashDraftModel scales the block's embeddings (input_embedding_scale), the logits (output_multiplier)
# and soft-caps them (final_logit_softcapping) by these keys of a z-lab config, dflash_config first, then the top
# level. dflash-fast neither writes nor trains with them, so only their neutral values are read.
ZLAB_NEUTRAL = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}


def _check_zlab_neutral(config: Dict) -> None:
    """Refuse a z-lab config.json that sets one of ZLAB_NEUTRAL to another value, naming the key."""
    for key, neutral in ZLAB_NEUTRAL.items():
        for prefix, holder in (("dflash_config.", config["dflash_config"]), ("", config)):
            if key in holder and holder[key] != neutral:
                raise ExportError(
                    f"config.json: {prefix}{key}={holder[key]!r}: z-lab's DFlashDraftModel would apply it, while "
                    f"training and eval here do not (the drafter would be served differently from how it is "
                    f"evaluated); remove the key or set it to {json.dumps(neutral)}"
                )


def zlab_tap_problems(layer_ids: List[int], target_num_layers: int) -> List[str]:
    """One line when `layer_ids` holds the target's last layer L-1, which the z-lab layout's readers do not tap as
    trained: z-lab's DFlashDraftModel (dflash 0.1.0, model.py extract_context_feature) reads layer id l as HF's
    hidden_states[l + 1], for l = L-1 the final norm's OUTPUT, while the store holds its input (spec.md §1, §2); and
    SGLang (models/qwen3.py set_dflash_layers_to_capture) captures id + 1 "before layer i" inside its loop over the
    L layers, which never reaches i = L."""
    last = target_num_layers - 1
    if last not in layer_ids:
        return []
    return [f"layer id {last} (the target's last layer, L = {target_num_layers}): z-lab's DFlashDraftModel reads it "
            f"as hidden_states[{last + 1}], AFTER the final norm, and SGLang captures it before a layer {last + 1} "
            f"that does not exist; the drafter trained on the norm's input. Export --format speculators (vLLM "
            f"taps it before the norm, docs/engine-target.md) or train without layer id {last}"]


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
        **read_families(VIEW_SGLANG, config, hf, where),
    }


def _vllm_zlab_view(config: Dict) -> Dict:
    """vLLM reading the z-lab layout (`--speculative-config '{"method": "dflash", "model": DIR}'`): AutoConfig
    (Qwen3Config) of config.json and qwen3_dflash.py's rules (see _vllm_layers, _vllm_rope); the block is the
    command line's num_speculative_tokens + 1, which docs/export.md tells you to set to block_size - 1.
    A family's architecture (DFlash2DraftModel: qwen3_dflash2.py, LiLiCorrDraftModel: lilicorr.py) is read by its
    serving home."""
    where = "vLLM (qwen3_dflash.py)"
    hf = _hf_config(config, where)
    family = read_families(VIEW_VLLM_ZLAB, config, hf, where)
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
        **family,
    }


VIEWS = {
    ("speculators", "speculators"): _speculators_view,
    ("speculators", "vllm"): _vllm_speculators_view,
    ("zlab", "sglang"): _sglang_view,
    ("zlab", "vllm"): _vllm_zlab_view,
}
