"""The drafter in the terms every serving engine is compared in (`ARCHITECTURE`): what the trained drafter is
(`architecture`), and the DSpark, DFlash2 and LiLiCorr fields as each view reports them. dflash_fast.serve.views
reads an export as each engine does into these terms; dflash_fast.serve.engines compares them.
"""
from typing import Dict

from dflash_fast.drafter.config import DFLASH_ONLY, DrafterConfig, DrafterOptions
from dflash_fast.serve.layouts import DFLASH2_FIELDS, LILICORR_FIELDS

# What a serving engine builds: the sizes and ids the target gives, then the drafter's options (DrafterOptions), the
# per-layer ones as one window and one attention rule per drafter layer (PER_LAYER: layer_types and sliding_window
# -> layer_windows, causal_in_block -> layer_causal); window_from is None without a sliding layer. DFlash drafters
# carry the DSpark options at DFLASH_ONLY, DFlash2's at 0, 16, 0, 16 and LiLiCorr's at LILICORR_OFF. `architecture`
# and every engine view return these keys.
PER_LAYER = {"layer_types": "layer_windows", "sliding_window": None, "causal_in_block": "layer_causal"}


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
    "rms_norm_eps",
    "rope_parameters",
    "max_position_embeddings",
) + tuple(PER_LAYER.get(key, key) for key in DrafterOptions.names()
        if PER_LAYER.get(key, key))


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
        **_dflash2_fields(*(getattr(cfg, key) for key in DFLASH2_FIELDS)),
        **_lilicorr_fields({key: getattr(cfg, key) for key in LILICORR_FIELDS}, cfg.hidden_size),
    }


def _dspark_fields(sample_from_anchor, markov_rank, markov_head_type, confidence_head, with_markov) -> Dict:
    """The DSpark fields of `ARCHITECTURE`; without a confidence head its input is moot and reads as true."""
    return dict(sample_from_anchor=sample_from_anchor, markov_rank=markov_rank, markov_head_type=markov_head_type,
                confidence_head=confidence_head, confidence_head_with_markov=with_markov or not confidence_head)


def _dflash2_fields(taps, group, rank, top_k) -> Dict:
    """DFlash2's fields of `ARCHITECTURE`; without a convolution its group size, without a selector its K, is moot
    and reads as the default 16."""
    return dict(conv_kernel_size=taps, conv_group_size=group if taps else 16, selector_rank=rank,
                selector_top_k=top_k if rank else 16)


DFLASH2_OFF = _dflash2_fields(0, 16, 0, 16)


def _lilicorr_fields(values: Dict, hidden_size) -> Dict:
    """LiLiCorr's fields of `ARCHITECTURE` (LILICORR_FIELDS) as its head is built: the lattice width
    lilicorr_hidden_size, 0 read as the drafter's hidden size (vLLM's LiLiCorrHead: `config[...] or
    model_hidden_size`); with lilicorr_candidate_topk 0 (no lattice) every other field is moot and reads as
    DrafterOptions' default."""
    if not values["lilicorr_candidate_topk"]:
        return dict(LILICORR_OFF)
    return dict(values, lilicorr_hidden_size=values["lilicorr_hidden_size"] or hidden_size)


LILICORR_OFF = {key: getattr(DrafterOptions, key) for key in LILICORR_FIELDS}


def normal_rope(params: Dict) -> Dict:
    """RoPE parameters as the drafter's Rope reads them: rope_type (not the legacy `type`), no factor-1 partial."""
    rope = dict(params)
    legacy = rope.pop("type", None)
    rope.setdefault("rope_type", legacy or "default")
    if rope.get("partial_rotary_factor", 1.0) == 1.0:
        rope.pop("partial_rotary_factor", None)
    return rope
