"""How each serving engine reads an export, modelled on the CPU: from a config.json of either layout
(`dflash_fast.serve.layouts`) transformers' Qwen3Config, then that engine's own rules (which window, which in-block
mask, which RoPE, which layer ids; each rule cites the engine's file and function), giving the drafter it would build
in the terms of `architecture.ARCHITECTURE`. `VIEWS`: each format's engines and their view.

    speculators layout   speculators (`_speculators_view`), vLLM (`_vllm_speculators_view`)
    zlab layout          SGLang (`_sglang_view`), vLLM (`_vllm_zlab_view`)

DFlash2 (spec.md §9) in either layout: speculators' DFlash2SpeculatorConfig, vLLM's qwen3_dflash2.py (read from the
speculators layout's top level through its adapter, from the z-lab layout's dflash_config), SGLang's and z-lab's
DFlash2DraftModel (dflash_config); `architecture._dflash2_fields` are their terms.

LiLiCorr (spec.md §11): only vLLM reads it, from the z-lab layout as architectures ["LiLiCorrDraftModel"]
(`_vllm_lilicorr`: lilicorr.py's LiLiCorr and LiLiCorrForCausalLM); every other view of every layout builds no
lattice (`architecture.LILICORR_OFF`), so a LiLiCorr drafter written as plain DFlash or DFlash2 reads as a mismatch.
"""
import json
from typing import Dict, List, Optional

from dflash_fast.drafter.config import DFLASH_ONLY, lilicorr_problems
from dflash_fast.errors import is_int
from dflash_fast.serve.architecture import (
    DFLASH2_OFF,
    LILICORR_OFF,
    _dflash2_fields,
    _dspark_fields,
    _lilicorr_fields,
    normal_rope,
)
from dflash_fast.serve.layouts import CONV_FIELDS, DFLASH2_FIELDS, HF_LAYER_TYPES, LILICORR_FIELDS, ExportError
from dflash_fast.store.layer_ids import default_layer_ids


def _dflash2_read(holder: Dict, where: str, defaults: Optional[Dict] = None) -> Dict:
    """DFlash2's four fields from `holder` (a config.json's top level or its dflash_config), each an integer >= 1 as
    the engine builds it (speculators: pydantic ge=1; vLLM, z-lab: int(dflash_config[key]) with no default; a
    convolution needs its group to divide the hidden size, checked by _check_values); `defaults` fills absent
    keys (speculators' DFlash2SpeculatorConfig: 2, 16, 256, 16), else an absent key is refused."""
    values = {}
    for key in DFLASH2_FIELDS:
        value = holder.get(key, (defaults or {}).get(key))
        if not is_int(value) or value < 1:
            raise ExportError(f"{where}: {key}={value!r}; its DFlash2 model builds that size, an integer >= 1 "
                              f"(speculators' DFlash2SpeculatorConfig names the four fields {list(DFLASH2_FIELDS)})")
        values[key] = value
    return _dflash2_fields(*values.values())


SPECULATORS_DFLASH2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16)


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
    dspark = config.get("speculators_model_type") == "dspark"
    dflash2 = config.get("speculators_model_type") == "dflash2"
    if config.get("sample_from_anchor", False) and dflash2:
        raise ExportError(f"{where}: a DFlash2 drafter with sample_from_anchor=true: speculators' DFlash2 and vLLM's "
                          f"dflash2 draft with the anchor as the given token (sample_from_anchor=false) only")
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
        # models/dflash2/config.py: DFlash2SpeculatorConfig's defaults, each ge=1
        **(_dflash2_read(config, where + ": DFlash2SpeculatorConfig", SPECULATORS_DFLASH2) if dflash2 else DFLASH2_OFF),
        **LILICORR_OFF,
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
    dspark = _vllm_dspark(config, where) if config.get("speculators_model_type") == "dspark" else DFLASH_ONLY
    dflash2 = DFLASH2_OFF
    if config.get("speculators_model_type") == "dflash2":
        dflash2 = _dflash2_read({k: config[k] for k in DFLASH2_FIELDS if config.get(k) is not None},
                                where.replace("qwen3_dflash.py", "qwen3_dflash2.py"))
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
        **dflash2,
        **LILICORR_OFF,
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
        **DFLASH_ONLY,
        **_sglang_dflash2(config, where),
        **LILICORR_OFF,
    }


def _sglang_dflash2(config: Dict, where: str) -> Dict:
    """SGLang, models/dflash.py: every DFlash draft builds the convolutions when dflash_config.conv_kernel_size is
    set (DFlashDraftModel.__init__, grouped_conv), only DFlash2DraftModel the candidate selector (it raises without
    selector_rank). Its parse_dflash_draft_config (not read here) is modelled as dflash_config's four fields, none
    defaulted: where z-lab's published DFlash2 checkpoint has them and the zlab layout writes them."""
    dflash = config["dflash_config"]
    if "DFlash2DraftModel" in config["architectures"]:
        return _dflash2_read(dflash, where + ": dflash_config")
    if dflash.get("conv_kernel_size"):
        taps = _dflash2_read({**dflash, "selector_rank": 1, "selector_top_k": 1}, where + ": dflash_config")
        return dict(taps, selector_rank=0, selector_top_k=16)
    return DFLASH2_OFF


def _vllm_lilicorr(config: Dict, hf) -> Dict:
    """vLLM 0.32 serving architectures ["LiLiCorrDraftModel"] (model_executor/models/lilicorr.py; its `dflash` method
    picks LiLiCorrSpeculator by that name, v1/worker/gpu/spec_decode/__init__.py): DFlash2's fields and LiLiCorr's
    (`_lilicorr_fields`), refusing, with the field named, what vLLM refuses or would serve otherwise than trained:
    lilicorr_enabled false; a lilicorr_* key absent (LiLiCorrHead reads each as config[key]); a K other than a power
    of two <= 16, heads not dividing the lattice width (LiLiCorrHead, LiLiCorrLatticeAttention raise); one
    convolution field without the other (LiLiCorr.__init__); a block with no slot to draft (vLLM needs 1 <=
    num_speculative_tokens < block_size); a draft vocabulary other than the target's (LiLiCorrForCausalLM: "LiLiCorr
    candidates require the full target vocabulary", no d2t map); has_own_lm_head true (the candidates would be
    an lm_head.weight of the checkpoint's, ours are the target's)."""
    where = "vLLM (lilicorr.py, LiLiCorrDraftModel) cannot serve this config.json as it trained:"
    dflash = config["dflash_config"]
    problems = []
    if not dflash.get("lilicorr_enabled", True):
        problems.append(f"dflash_config.lilicorr_enabled={dflash['lilicorr_enabled']!r}: vLLM raises "
                        f"(\"LiLiCorr requires lilicorr_enabled=True\"); write true")
    absent = [key for key in LILICORR_FIELDS if key not in dflash]
    if absent:
        problems.append(f"dflash_config has no {absent}: vLLM's LiLiCorrHead reads each, with no default")
    values = {key: dflash.get(key) for key in LILICORR_FIELDS}
    if not absent:
        if values["lilicorr_candidate_topk"] == 0:
            problems.append("dflash_config.lilicorr_candidate_topk=0: vLLM's LiLiCorrHead needs a power of two <= 16")
        problems += [f"dflash_config.{line}" for line in lilicorr_problems({**values, "hidden_size": hf.hidden_size})]
        block = dflash.get("block_size", config.get("block_size", 0))  # LiLiCorr.__init__'s reading
        if not is_int(block) or block < 2:
            problems.append(f"dflash_config.block_size={block!r}: vLLM needs 1 <= num_speculative_tokens < "
                            f"block_size, the trained block (>= 2)")
    taps, group = dflash.get(CONV_FIELDS[0], 0), dflash.get(CONV_FIELDS[1], 0)
    if not (is_int(taps) and is_int(group)) or taps < 0 or group < 0 or bool(taps) != bool(group):
        problems.append(f"dflash_config.conv_kernel_size={taps!r}, conv_group_size={group!r}: vLLM's LiLiCorr builds "
                        f"DFlash2's convolutions with both >= 1 or neither (0 or absent)")
    draft_vocab = config.get("draft_vocab_size")
    if draft_vocab is not None and draft_vocab != hf.vocab_size:
        problems.append(f"draft_vocab_size={draft_vocab} of a {hf.vocab_size}-token vocabulary: LiLiCorr's candidates "
                        f"need the target's full vocabulary (vLLM refuses a draft-to-target map)")
    if config.get("has_own_lm_head"):
        problems.append("has_own_lm_head=true: vLLM would draw the candidates from an lm_head.weight of the export, "
                        "dflash-fast's drafter drafts through the target's lm_head (write false)")
    if problems:
        raise ExportError(where + "\n  - " + "\n  - ".join(problems))
    conv = _dflash2_fields(taps, group, 0, 16) if taps else DFLASH2_OFF
    return {**conv, **_lilicorr_fields(values, hf.hidden_size)}


def _vllm_zlab_view(config: Dict) -> Dict:
    """vLLM reading the z-lab layout (`--speculative-config '{"method": "dflash", "model": DIR}'`): AutoConfig
    (Qwen3Config) of config.json and qwen3_dflash.py's rules (see _vllm_layers, _vllm_rope); the block is the
    command line's num_speculative_tokens + 1, which docs/export.md tells you to set to block_size - 1.
    architectures ["DFlash2DraftModel"]: qwen3_dflash2.py, DFlash2's fields from dflash_config;
    ["LiLiCorrDraftModel"]: lilicorr.py (`_vllm_lilicorr`)."""
    where = "vLLM (qwen3_dflash.py)"
    hf = _hf_config(config, where)
    if "LiLiCorrDraftModel" in config["architectures"]:
        family = _vllm_lilicorr(config, hf)
    elif "DFlash2DraftModel" in config["architectures"]:
        family = {**_dflash2_read(config["dflash_config"], "vLLM (qwen3_dflash2.py): dflash_config"), **LILICORR_OFF}
    else:
        family = {**DFLASH2_OFF, **LILICORR_OFF}
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
        **family,
    }


VIEWS = {
    ("speculators", "speculators"): _speculators_view,
    ("speculators", "vllm"): _vllm_speculators_view,
    ("zlab", "sglang"): _sglang_view,
    ("zlab", "vllm"): _vllm_zlab_view,
}
