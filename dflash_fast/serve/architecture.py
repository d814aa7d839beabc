"""The drafter in the terms every serving engine is compared in (`ARCHITECTURE`): what the trained drafter is
(`architecture`; each family's terms are its serving home's, dflash_fast.serve.families). dflash_fast.serve.views
reads an export as each engine does into these terms; dflash_fast.serve.engines compares them.
"""
from typing import Dict

from dflash_fast.drafter.config import DrafterConfig, DrafterOptions
from dflash_fast.serve.families import trained_fields

# What a serving engine builds: the sizes and ids the target gives, then the drafter's options (DrafterOptions), the
# per-layer ones as one window and one attention rule per drafter layer (PER_LAYER: layer_types and sliding_window
# -> layer_windows, causal_in_block -> layer_causal); window_from is None without a sliding layer. A drafter carries
# every other family's options at that family's `off` (families.OFF). `architecture` and every engine view return
# these keys.
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
        **trained_fields(cfg),
    }


def normal_rope(params: Dict) -> Dict:
    """RoPE parameters as the drafter's Rope reads them: rope_type (not the legacy `type`), no factor-1 partial."""
    rope = dict(params)
    legacy = rope.pop("type", None)
    rope.setdefault("rope_type", legacy or "default")
    if rope.get("partial_rotary_factor", 1.0) == 1.0:
        rope.pop("partial_rotary_factor", None)
    return rope
