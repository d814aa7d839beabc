"""The two export layouts a trained drafter is written in: config.json of each, and the JSON shape their readers
take (`CONFIG_SCHEMAS`). `dflash_fast.serve.export` writes them (gated), `dflash_fast.serve.engines` reads them as
each serving engine does.

    OUT/config.json         one of the two layouts below (written atomically)
    OUT/model.safetensors   trainable weights only, under the names both layouts use: fc, hidden_norm,
                            layers.{i}.{self_attn,mlp,...}, norm (embedding, lm_head and final norm are the target's)

    speculators  read by vLLM and vllm-project/speculators: {speculators_model_type: "dflash",
                 transformer_layer_config: a Qwen3 config, aux_hidden_state_layer_ids = ids + 1, block_size, ...};
                 a DSpark drafter (spec.md §8) as speculators_model_type "dspark" (vLLM's `dspark` method) with
                 sample_from_anchor, markov_rank, markov_head_type, enable_confidence_head,
                 confidence_head_with_markov and the heads' weights markov_head.markov_w1 / markov_w2,
                 confidence_head.proj; a DFlash2 drafter (spec.md §9) as speculators_model_type "dflash2" (vLLM's
                 `dflash` method with its DFlash2DraftModel, V2 runner) with conv_kernel_size, conv_group_size,
                 selector_rank, selector_top_k and the tensors layers.{i}.{attention_conv,mlp_conv}.base_kernel /
                 .kernel_projection.weight, candidate_selector.predecessor_codebook / .successor_codebook /
                 .hidden_projection.weight
    zlab         read by SGLang and vLLM, the layout of z-lab's published drafters: a flat Qwen3 config with
                 architectures ["DFlashDraftModel"], block_size, num_target_layers,
                 dflash_config {target_layer_ids = ids, mask_token_id, block_size}; a DFlash2 drafter as
                 architectures ["DFlash2DraftModel"] and DFlash2's four fields in dflash_config (z-lab's
                 Qwen3.8-27B-DFlash2), the same tensor names as the speculators layout; a LiLiCorr drafter (spec.md
                 §11) as architectures ["LiLiCorrDraftModel"] (vLLM's `dflash` method with its LiLiCorrForCausalLM,
                 V2 runner; no other engine reads it) with lilicorr_enabled, the eight lilicorr_* fields and, with
                 DFlash2's convolutions, conv_kernel_size and conv_group_size in dflash_config, has_own_lm_head false,
                 and the lattice head's tensors lilicorr.* (vLLM's LiLiCorrHead names)

Layer ids: ours name HF `hidden_states[id + 1]` (spec.md §1), and so do z-lab's target_layer_ids; speculators numbers
the same tensors one higher.
"""
from typing import Dict, Optional

from dflash_fast.drafter.config import DFLASH_ONLY, DrafterConfig, DrafterOptions
from dflash_fast.errors import BOOL, COUNT, INT, NUMBER, OBJECT, STR, ListOf, MapOf, Nullable, Obj

FORMATS = ("speculators", "zlab")
HF_LAYER_TYPES = {"full": "full_attention", "sliding": "sliding_attention"}
# DFlash2's fields (spec.md §9) as speculators' DFlash2SpeculatorConfig names them (models/dflash2/config.py)
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# LiLiCorr's fields (spec.md §11) under the names vLLM's LiLiCorrHead reads from dflash_config (lilicorr.py)
LILICORR_FIELDS = tuple(key for key in DrafterOptions.names() if key.startswith("lilicorr_"))
# DFlash2's convolution fields, which vLLM's LiLiCorr reads from dflash_config (LiLiCorr.__init__: both or neither)
CONV_FIELDS = DFLASH2_FIELDS[:2]


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
    """The drafter has a DSpark field other than DFlash's (spec.md §8): exported as speculators' `dspark` type."""
    return any(getattr(cfg, key) != value for key, value in DFLASH_ONLY.items())


def speculators_algorithm(cfg: DrafterConfig) -> str:
    """speculators_model_type of a drafter: dflash2 (spec.md §9), dspark (spec.md §8) or dflash."""
    return cfg.family


ARCHITECTURES = {"dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel", "dflash2": "DFlash2DraftModel"}


def speculators_config(cfg: DrafterConfig, verifier: str) -> Dict:
    """config.json of the speculators layout (DSpark fields as speculators' DSparkSpeculatorConfig names them,
    DFlash2's as DFlash2SpeculatorConfig does)."""
    # vLLM turns this flag into one in-block rule for EVERY layer (update_dflash: dflash_config.causal = not
    # sliding_window_non_causal): true unless a sliding layer is causal, so full-layer drafters stay bidirectional.
    causal_sliding = any(c for c, kind in zip(cfg.causal_in_block, cfg.layer_types) if kind == "sliding")
    algorithm = speculators_algorithm(cfg)
    dspark = {}
    if algorithm == "dflash2":
        dspark = {key: getattr(cfg, key) for key in DFLASH2_FIELDS}
    if algorithm == "dspark":
        dspark = {
            "markov_rank": cfg.markov_rank,
            "markov_head_type": cfg.markov_head_type,
            "enable_confidence_head": cfg.confidence_head,
            "confidence_head_with_markov": cfg.confidence_head_with_markov,
        }
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
        **dspark,
        "speculators_config": {
            "algorithm": algorithm,
            # speculators (_build_base_config_kwargs): block_size tokens with sample_from_anchor, else block_size - 1
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.drafted_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": []},
        },
        "dflash_fast": _metadata(cfg, verifier),
    }


ZLAB_ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel", "lilicorr": "LiLiCorrDraftModel"}


def zlab_family_fields(cfg: DrafterConfig) -> Dict:
    """What a z-lab config.json's dflash_config carries beside the backbone's ids: DFlash2's four fields (z-lab's
    dflash 0.1.0 model.py, SGLang's models/dflash.py and vLLM's qwen3_dflash2.py read them there); LiLiCorr's
    lilicorr_enabled and eight fields (vLLM's LiLiCorrHead reads each as config[key], no default) and, with
    convolutions, their two fields (LiLiCorr.__init__)."""
    if cfg.family == "lilicorr":
        conv = {key: getattr(cfg, key) for key in CONV_FIELDS} if cfg.conv_kernel_size else {}
        return {"lilicorr_enabled": True, **{key: getattr(cfg, key) for key in LILICORR_FIELDS}, **conv}
    return {key: getattr(cfg, key) for key in DFLASH2_FIELDS} if cfg.is_dflash2 else {}


def zlab_config(cfg: DrafterConfig, verifier: str) -> Dict:
    """config.json of the z-lab layout (no auto_map: the z-lab Transformers backend's dflash.py is not shipped): the
    family's architecture (ZLAB_ARCHITECTURES; a DSpark drafter has none, engines.check_servable refuses it) and
    its fields in dflash_config (zlab_family_fields). A LiLiCorr drafter's candidates are the target's lm_head's:
    has_own_lm_head false (vLLM's LiLiCorrForCausalLM would otherwise require and use an lm_head.weight)."""
    own_head = {"has_own_lm_head": False} if cfg.family == "lilicorr" else {}
    return {
        **qwen3_layer(cfg),
        "architectures": [ZLAB_ARCHITECTURES.get(cfg.family, "DFlashDraftModel")],
        **own_head,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.target_num_layers,
        "dflash_config": {
            "target_layer_ids": list(cfg.layer_ids),
            "mask_token_id": cfg.mask_token_id,
            "block_size": cfg.block_size,
            **zlab_family_fields(cfg),
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


# The JSON shape of the keys each layout's readers take from config.json (errors.check_schema); the sizes inside
# transformer_layer_config / the z-lab top level are transformers' (_hf_config) and _check_values' to judge.
_OPT_INT, _OPT_BOOL = Nullable(INT), Nullable(BOOL)
# Our metadata (_metadata): `thinking` counts the training conversations by the thinking switch they were rendered
# with (the store's extraction.thinking; export_drafter writes it), what `dflash-fast eval` warns against.
_OURS = Nullable(Obj({}, optional={"thinking": Nullable(MapOf(COUNT))}))


_DFLASH_KEYS = {"target_layer_ids": ListOf(INT), "num_target_layers": _OPT_INT, "mask_token_id": _OPT_INT,
                "block_size": _OPT_INT,
                # z-lab's scalings (views.ZLAB_NEUTRAL: only their neutral values are read)
                "input_embedding_scale": NUMBER, "output_multiplier": NUMBER,
                "final_logit_softcapping": Nullable(NUMBER), **{key: _OPT_INT for key in DFLASH2_FIELDS}}
# LiLiCorr's dflash_config keys (vLLM's LiLiCorrHead: int sizes, float ratio, eps and scale; lilicorr_enabled a flag)
_LILICORR_KEYS = {"lilicorr_enabled": _OPT_BOOL, "lilicorr_mlp_ratio": NUMBER, "lilicorr_vector_eps": NUMBER,
                  "lilicorr_logit_scale": NUMBER,
                  **{key: INT for key in LILICORR_FIELDS if key not in ("lilicorr_mlp_ratio", "lilicorr_vector_eps",
                                                                        "lilicorr_logit_scale")}}


CONFIG_SCHEMAS = {
    "speculators": Obj(
        {"transformer_layer_config": OBJECT, "aux_hidden_state_layer_ids": ListOf(INT)},
        optional={"speculators_config": Nullable(Obj({}, optional={
                      "proposal_methods": Nullable(ListOf(Obj({}, optional={"speculative_tokens": _OPT_INT})))})),
                  "mask_token_id": _OPT_INT, "block_size": _OPT_INT, "draft_vocab_size": _OPT_INT,
                  "target_hidden_size": _OPT_INT, "sample_from_anchor": _OPT_BOOL,
                  "sliding_window_non_causal": _OPT_BOOL, "dflash_fast": _OURS,
                  **{key: _OPT_INT for key in DFLASH2_FIELDS}},
    ),
    "zlab": Obj(
        {"architectures": ListOf(STR),
         "dflash_config": Obj({}, optional={**_DFLASH_KEYS, "use_swa": _OPT_BOOL, "swa_window_size": _OPT_INT,
                                            "causal": _OPT_BOOL, **_LILICORR_KEYS})},
        optional={**_DFLASH_KEYS, "layer_types": Nullable(ListOf(STR)), "dflash_fast": _OURS,
                  "has_own_lm_head": _OPT_BOOL, "draft_vocab_size": _OPT_INT},
    ),
}
