"""The two export layouts a trained drafter is written in: config.json of each, and the JSON shape their readers
take (`CONFIG_SCHEMAS`). `dflash_fast.serve.export` writes them (gated), `dflash_fast.serve.engines` reads them as
each serving engine does.

    OUT/config.json         one of the two layouts below (written atomically)
    OUT/model.safetensors   trainable weights only, under the names both layouts use: fc, hidden_norm,
                            layers.{i}.{self_attn,mlp,...}, norm (embedding, lm_head and final norm are the target's)

    speculators  read by vLLM and vllm-project/speculators: {speculators_model_type: the family ("dflash"),
                 architectures: its speculators model, transformer_layer_config: a Qwen3 config,
                 aux_hidden_state_layer_ids = ids + 1, block_size, ..., the family's fields}
    zlab         read by SGLang and vLLM, the layout of z-lab's published drafters: a flat Qwen3 config with
                 architectures [the family's z-lab model ("DFlashDraftModel")], block_size, num_target_layers,
                 dflash_config {target_layer_ids = ids, mask_token_id, block_size, the family's fields}

Which families each layout carries, under which names and fields, is each family's serving home's
(dflash_fast/serve/families/<family>.py: DSpark in the speculators layout alone, DFlash2 in both, LiLiCorr in the z-lab
layout alone); their tensors keep the drafter's own parameter names.

Layer ids: ours name HF `hidden_states[id + 1]` (spec.md §1), and so do z-lab's target_layer_ids; speculators numbers
the same tensors one higher.
"""
from typing import Dict, Optional

from dflash_fast.drafter.config import DrafterConfig
from dflash_fast.errors import BOOL, COUNT, INT, NUMBER, OBJECT, STR, ListOf, MapOf, Nullable, Obj
from dflash_fast.serve.families import LAYOUTS, schema, speculators_architectures, zlab_architectures
from dflash_fast.serve.families.base import ExportError

FORMATS = ("speculators", "zlab")
HF_LAYER_TYPES = {"full": "full_attention", "sliding": "sliding_attention"}


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


# speculators_model_type -> architectures, and family -> the z-lab layout's architectures (the families' homes)
ARCHITECTURES = speculators_architectures()
ZLAB_ARCHITECTURES = zlab_architectures()


def speculators_config(cfg: DrafterConfig, verifier: str) -> Dict:
    """config.json of the speculators layout: speculators_model_type is the family, its fields as its serving home
    writes them (DSpark's as speculators' DSparkSpeculatorConfig names them, DFlash2's as DFlash2SpeculatorConfig
    does)."""
    # vLLM turns this flag into one in-block rule for EVERY layer (update_dflash: dflash_config.causal = not
    # sliding_window_non_causal): true unless a sliding layer is causal, so full-layer drafters stay bidirectional.
    causal_sliding = any(c for c, kind in zip(cfg.causal_in_block, cfg.layer_types) if kind == "sliding")
    algorithm = cfg.family
    return {
        "speculators_model_type": algorithm,
        "architectures": [ARCHITECTURES[algorithm]],
        "transformer_layer_config": qwen3_layer(cfg),
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.layer_ids],
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "draft_vocab_size": cfg.vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "sliding_window_non_causal": not causal_sliding,
        "sample_from_anchor": cfg.sample_from_anchor,  # false: slot 0 is the given token, never drafted (spec.md §5)
        **LAYOUTS[algorithm].speculators_fields(cfg),
        "speculators_config": {
            "algorithm": algorithm,
            # speculators (_build_base_config_kwargs): block_size tokens with sample_from_anchor, else block_size - 1
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.drafted_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": []},
        },
        "dflash_fast": _metadata(cfg, verifier),
    }


def zlab_config(cfg: DrafterConfig, verifier: str) -> Dict:
    """config.json of the z-lab layout (no auto_map: the z-lab Transformers backend's dflash.py is not shipped): the
    family's architecture (ZLAB_ARCHITECTURES; a family without one, DSpark, is written as DFlash and refused by
    engines.check_servable) and its fields, at the top level and in dflash_config, as its serving home writes them."""
    top, family = LAYOUTS[cfg.family].zlab_fields(cfg)
    return {
        **qwen3_layer(cfg),
        "architectures": [ZLAB_ARCHITECTURES.get(cfg.family, ZLAB_ARCHITECTURES["dflash"])],
        **top,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.target_num_layers,
        "dflash_config": {
            "target_layer_ids": list(cfg.layer_ids),
            "mask_token_id": cfg.mask_token_id,
            "block_size": cfg.block_size,
            **family,
        },
        "dflash_fast": _metadata(cfg, verifier),
    }


def format_config(cfg: DrafterConfig, fmt: str, verifier: str) -> Dict:
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}: choose one of {FORMATS}")
    return speculators_config(cfg, verifier) if fmt == "speculators" else zlab_config(cfg, verifier)


def export_format(config: Dict) -> Optional[str]:
    """'speculators', 'zlab', or None for a config.json that is neither."""
    if config.get("speculators_model_type") in ARCHITECTURES:
        return "speculators"
    architectures = config.get("architectures") or []
    zlab = any(name in architectures for name in ZLAB_ARCHITECTURES.values())
    if zlab and isinstance(config.get("dflash_config"), dict):
        return "zlab"
    return None


# The JSON shape of the keys each layout's readers take from config.json (errors.check_schema), the families' keys
# from their serving homes (families.schema); the sizes inside transformer_layer_config / the z-lab top level are
# transformers' (_hf_config) and _check_values' to judge.
_OPT_INT, _OPT_BOOL = Nullable(INT), Nullable(BOOL)
# Our metadata (_metadata): `thinking` counts the training conversations by the thinking switch they were rendered
# with (the store's extraction.thinking; export_drafter writes it), what `dflash-fast eval` warns against.
_OURS = Nullable(Obj({}, optional={"thinking": Nullable(MapOf(COUNT))}))


_DFLASH_KEYS = {"target_layer_ids": ListOf(INT), "num_target_layers": _OPT_INT, "mask_token_id": _OPT_INT,
                "block_size": _OPT_INT,
                # z-lab's scalings (views.ZLAB_NEUTRAL: only their neutral values are read)
                "input_embedding_scale": NUMBER, "output_multiplier": NUMBER,
                "final_logit_softcapping": Nullable(NUMBER)}


CONFIG_SCHEMAS = {
    "speculators": Obj(
        {"transformer_layer_config": OBJECT, "aux_hidden_state_layer_ids": ListOf(INT)},
        optional={"speculators_config": Nullable(Obj({}, optional={
                      "proposal_methods": Nullable(ListOf(Obj({}, optional={"speculative_tokens": _OPT_INT})))})),
                  "mask_token_id": _OPT_INT, "block_size": _OPT_INT, "draft_vocab_size": _OPT_INT,
                  "target_hidden_size": _OPT_INT, "sample_from_anchor": _OPT_BOOL,
                  "sliding_window_non_causal": _OPT_BOOL, "dflash_fast": _OURS, **schema("speculators")},
    ),
    "zlab": Obj(
        {"architectures": ListOf(STR),
         "dflash_config": Obj({}, optional={**_DFLASH_KEYS, "use_swa": _OPT_BOOL, "swa_window_size": _OPT_INT,
                                            "causal": _OPT_BOOL, **schema("dflash_config")})},
        optional={**_DFLASH_KEYS, "layer_types": Nullable(ListOf(STR)), "dflash_fast": _OURS,
                  "draft_vocab_size": _OPT_INT, **schema("zlab")},
    ),
}
