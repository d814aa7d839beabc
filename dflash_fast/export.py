"""Export a trained drafter in the vllm-project/speculators DFlash format, and load one back.

    OUT/config.json         speculators config (`speculators_model_type: dflash`)
    OUT/model.safetensors   trainable weights only, speculators names (frozen verifier tensors are not saved)

Layer ids: ours name HF `hidden_states[id + 1]`; speculators numbers the same tensors one higher,
so `aux_hidden_state_layer_ids = ids + 1` (SPEC §1).
"""
import json
import os
from typing import Dict, Optional

import torch

from dflash_fast.checkpoint import load_drafter_for_export
from dflash_fast.drafter import DFlashDrafter, DrafterConfig, load_frozen_tensors
from dflash_fast.store import torch_dtype

HF_LAYER_TYPES = {"full": "full_attention", "sliding": "sliding_attention"}


def speculators_config(cfg: DrafterConfig, verifier: str) -> Dict:
    if any(cfg.causal_in_block) and "full" in cfg.layer_types:
        raise ValueError("the speculators format makes full-attention layers bidirectional in the block; "
                         "a drafter with causal_in_block and full layers cannot be exported to it")
    layer = {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_parameters": cfg.rope_parameters,
        "rope_theta": cfg.rope_parameters.get("rope_theta", 10000.0),
        "layer_types": [HF_LAYER_TYPES[k] for k in cfg.layer_types],
        "sliding_window": cfg.sliding_window,
        "attention_bias": False,
        "hidden_act": "silu",
    }
    return {
        "speculators_model_type": "dflash",
        "architectures": ["DFlashDraftModel"],
        "transformer_layer_config": layer,
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.layer_ids],
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "draft_vocab_size": cfg.vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "sliding_window_non_causal": not any(cfg.causal_in_block),
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size - 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": []},
        },
        "dflash_fast": {"target_num_layers": cfg.target_num_layers, "causal_in_block": cfg.causal_in_block,
                        "target_model_type": cfg.target_model_type},
    }


def trainable_state_dict(drafter: DFlashDrafter) -> Dict[str, torch.Tensor]:
    """Module names already follow speculators' (`fc.weight`, `layers.{i}.self_attn.q_proj.weight`, ...)."""
    return {name: p.detach().contiguous() for name, p in drafter.named_parameters()}


def export_drafter(drafter: DFlashDrafter, out_dir: str, verifier: str, dtype: Optional[torch.dtype] = torch.bfloat16,
                   state_dict: Optional[Dict[str, torch.Tensor]] = None) -> str:
    """Write OUT/config.json and OUT/model.safetensors; `state_dict` overrides the module's own
    (e.g. weights gathered from ZeRO-3). Returns out_dir."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    tensors = state_dict if state_dict is not None else trainable_state_dict(drafter)
    tensors = {k: (v.to(dtype) if dtype is not None else v).cpu().contiguous() for k, v in tensors.items()}
    tmp = os.path.join(out_dir, "model.safetensors.tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(speculators_config(drafter.config, verifier), f, indent=2)
    return out_dir


def config_from_export(config: Dict, target_config=None) -> DrafterConfig:
    """DrafterConfig from a speculators DFlash config.json (ours or another tool's)."""
    if config.get("speculators_model_type") != "dflash":
        raise ValueError(
            f"not a speculators DFlash export: speculators_model_type = {config.get('speculators_model_type')!r}"
        )
    layer = config["transformer_layer_config"]
    ours = config.get("dflash_fast", {})
    kinds = {v: k for k, v in HF_LAYER_TYPES.items()}
    num_layers = layer["num_hidden_layers"]
    layer_types = [kinds[t] for t in layer.get("layer_types") or ["full_attention"] * num_layers]
    rope = layer.get("rope_parameters") or {"rope_type": "default", "rope_theta": layer.get("rope_theta", 10000.0)}
    causal = ours.get("causal_in_block", False)
    if "dflash_fast" not in config and "sliding" in layer_types and not config.get("sliding_window_non_causal", False):
        raise ValueError(
            "this export has sliding layers that are causal in the block next to bidirectional full layers; "
            "dflash-fast drafters use one in-block rule for every layer"
        )
    target_layers = ours.get("target_num_layers")
    if target_layers is None and target_config is not None:
        tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        target_layers = tc.num_hidden_layers
    return DrafterConfig(
        hidden_size=layer["hidden_size"],
        num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer.get("num_key_value_heads", layer["num_attention_heads"]),
        head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
        intermediate_size=layer["intermediate_size"],
        vocab_size=config.get("draft_vocab_size", layer["vocab_size"]),
        layer_ids=[i - 1 for i in config["aux_hidden_state_layer_ids"]],
        target_num_layers=target_layers if target_layers is not None else max(config["aux_hidden_state_layer_ids"]),
        target_hidden_size=config.get("target_hidden_size") or layer["hidden_size"],
        mask_token_id=config["mask_token_id"],
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        rope_parameters=rope,
        max_position_embeddings=layer.get("max_position_embeddings", 32768),
        num_layers=num_layers,
        block_size=config["block_size"],
        layer_types=layer_types,
        sliding_window=layer.get("sliding_window"),
        causal_in_block=causal,
        target_model_type=ours.get("target_model_type", ""),
    )


def load_exported(export_dir: str, target_path: Optional[str] = None) -> DFlashDrafter:
    """Load an export back into a DFlashDrafter; with target_path, also load the frozen tensors."""
    from safetensors.torch import load_file

    with open(os.path.join(export_dir, "config.json")) as f:
        config = json.load(f)
    target_config = None
    if target_path is not None:
        from transformers import AutoConfig

        target_config = AutoConfig.from_pretrained(target_path)
    drafter = DFlashDrafter(config_from_export(config, target_config))
    weights = load_file(os.path.join(export_dir, "model.safetensors"))
    expected = dict(drafter.named_parameters())
    missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or extra:
        raise ValueError(
            f"{export_dir}/model.safetensors does not match the drafter: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    with torch.no_grad():
        for name, p in expected.items():
            p.copy_(weights[name].to(p.dtype))
    if target_path is not None:
        drafter.set_frozen(**load_frozen_tensors(target_path))
    return drafter


def add_arguments(parser):
    parser.add_argument(
        "--checkpoint", required=True, help="a trainer run directory, its checkpoints/ directory or one checkpoint"
    )
    parser.add_argument("--out", required=True, help="export directory")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])


def run(args):
    dtype = torch_dtype(args.dtype)
    drafter, verifier = load_drafter_for_export(args.checkpoint)
    export_drafter(drafter, args.out, verifier, dtype)
    print(f"exported {sum(p.numel() for p in drafter.parameters()):,} parameters to {args.out}")
