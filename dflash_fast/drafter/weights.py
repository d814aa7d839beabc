"""The drafter's weights read from a file, before anything is built from them: the trainable tensors a
`DrafterConfig` implies (`trainable_shapes`, `trainable_parameters`), THE check of those a checkpoint or an export
holds (`check_tensors`, `read_tensors`: names, shapes, dtypes, finite values, sizes; never unpickled), and the frozen
tensors read from the target (`load_frozen_tensors`: embed_tokens, lm_head and the final norm, never the whole
target)."""
import math
import os
import sys
from typing import Callable, Dict, Mapping, NamedTuple, Optional, Sequence, Tuple, Type, Union

import torch

from dflash_fast.drafter import dflash2, dspark, lilicorr
from dflash_fast.drafter.config import DrafterConfig
from dflash_fast.errors import OBJECT, WEIGHTS_INDEX_SCHEMA, Obj, read_json_object
from dflash_fast.target.norm import final_norm_weight

# Models whose RMSNorm scales by (1 + w): the frozen final norm is stored as the effective weight.
ZERO_CENTRED_NORM_MODELS = (
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_text",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "gemma",
    "gemma2",
    "gemma3",
    "gemma3_text",
)


def trainable_parameters(cfg: DrafterConfig) -> int:
    """The number of trainable parameters DFlashDrafter(cfg) holds, computed from the sizes alone (nothing built)."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    layer = 2 * h + 2 * d + h * (2 * q + 2 * kv) + 3 * h * i
    heads = sum(math.prod(shape) for shape in head_shapes(cfg).values())
    return h * cfg.num_tapped * cfg.target_hidden_size + 2 * h + cfg.num_layers * layer + heads


TENSORS_PER_LAYER = 11  # input and post-attention norms, q/k/v/o, q and k norms, gate/up/down


def trainable_shapes(cfg: DrafterConfig) -> Dict[str, Tuple[int, ...]]:
    """name -> shape of every trainable parameter of DFlashDrafter(cfg), computed from the sizes alone."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes = {"fc.weight": (h, cfg.num_tapped * cfg.target_hidden_size), "hidden_norm.weight": (h,)}
    for n in range(cfg.num_layers):
        shapes.update({
            f"layers.{n}.input_layernorm.weight": (h,),
            f"layers.{n}.self_attn.q_proj.weight": (q, h),
            f"layers.{n}.self_attn.k_proj.weight": (kv, h),
            f"layers.{n}.self_attn.v_proj.weight": (kv, h),
            f"layers.{n}.self_attn.o_proj.weight": (h, q),
            f"layers.{n}.self_attn.q_norm.weight": (d,),
            f"layers.{n}.self_attn.k_norm.weight": (d,),
            f"layers.{n}.post_attention_layernorm.weight": (h,),
            f"layers.{n}.mlp.gate_proj.weight": (i, h),
            f"layers.{n}.mlp.up_proj.weight": (i, h),
            f"layers.{n}.mlp.down_proj.weight": (h, i),
        })
    shapes["norm.weight"] = (h,)
    return {**shapes, **head_shapes(cfg)}


def head_shapes(cfg: DrafterConfig) -> Dict[str, Tuple[int, ...]]:
    """The trainable tensors a family adds to the DFlash backbone: DSpark's heads, DFlash2's convolutions and
    selector, LiLiCorr's lattice (each empty when off)."""
    return {**dspark.head_shapes(cfg), **dflash2.head_shapes(cfg), **lilicorr.head_shapes(cfg)}


# ---------------------------------------------------------------- the trainable weights read from a file


# The dtypes a drafter weight may be stored in (what exports and checkpoints write, and fp64).
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# A trained drafter weight stays within ~10^2; beyond this a file is more likely corrupt or edited than trained.
LARGE_WEIGHT = 1e4


class TensorInfo(NamedTuple):
    """What a safetensors header says of one tensor, before its bytes are read."""

    shape: Tuple[int, ...]
    dtype: torch.dtype


def stderr_line(message: str) -> None:
    print(message, file=sys.stderr)


def check_tensors(
    cfg: DrafterConfig,
    tensors: Mapping[str, Union[torch.Tensor, TensorInfo]],
    where: str,
    error: Type[Exception] = ValueError,
    unused: Sequence[str] = (),
    warn: Callable[[str], None] = stderr_line,
) -> None:
    """THE check of a drafter's trainable tensors read from (or written to) a file `where`, before they are used:
    the parameter and tensor counts the config implies against those present (a config of 10^12 parameters or
    10^5 layers is refused with the numbers, never built), then every name, shape and dtype, and for loaded
    tensors (not `TensorInfo`s) every value finite. No name is exempt; `unused` names (tensors other tools store
    beside the drafter, never read) need only a floating-point dtype. A weight beyond LARGE_WEIGHT in magnitude
    gets one warning line naming the file and the tensor. Raises `error`, naming the file and every tensor that
    fails."""
    held = {name: t for name, t in tensors.items() if name not in unused}
    implied, present = trainable_parameters(cfg), sum(math.prod(t.shape) for t in held.values())
    count = (f"its config implies {implied:,} trainable parameters in {TENSORS_PER_LAYER * cfg.num_layers + 3} "
             f"tensors ({cfg.num_layers} layers) but the file holds {present:,} in {len(held)} tensors")
    if TENSORS_PER_LAYER * cfg.num_layers + 3 > len(held):  # layers the file cannot hold: not even listed
        raise error(f"{where}: {count}: refused before building anything (the config was edited, or the weights "
                    f"are not this config's)")
    expected = trainable_shapes(cfg)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected) - set(unused))
    problems = [f"{count}: refused before building anything"] if implied > present else []
    if missing or unexpected:
        problems.append(f"missing {missing[:6]}, unexpected {unexpected[:6]}")
    fc = tensors.get("fc.weight")
    if fc is not None and len(fc.shape) == 2 and tuple(fc.shape) != expected["fc.weight"]:
        problems.append(
            f"fc.weight is {list(fc.shape)}: {fc.shape[1] / cfg.target_hidden_size:g} tapped layers of hidden size "
            f"{cfg.target_hidden_size}, but the config lists {cfg.num_tapped} target layer ids {cfg.layer_ids} "
            f"(expected {list(expected['fc.weight'])}); a drafter is never sliced to fit"
        )
    for name, t in tensors.items():
        shape = expected.get(name)
        if t.dtype not in WEIGHT_DTYPES:
            problems.append(f"{name} has dtype {t.dtype}, not a floating-point weight (fp32, bf16, fp16 or fp64)")
        elif shape is None:
            continue
        elif tuple(t.shape) != shape:
            if name != "fc.weight" or len(t.shape) != 2:
                problems.append(f"{name} is {list(t.shape)}, the config makes it {list(shape)}")
        elif isinstance(t, torch.Tensor) and not torch.isfinite(t).all():
            problems.append(f"{name} holds non-finite values (an fp16 export of weights beyond 65504 overflows)")
    if problems:
        raise error(f"{where}:\n  - " + "\n  - ".join(problems))
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and name in expected and t.numel():
            largest = t.detach().abs().max().item()
            if largest > LARGE_WEIGHT:
                warn(f"warning: {where}: {name} holds a weight of magnitude {largest:.3g} (beyond {LARGE_WEIGHT:g}: "
                     f"a corrupt or edited file?)")


def read_tensors(
    files: Sequence[str],
    cfg: DrafterConfig,
    error: Type[Exception] = ValueError,
    unused: Sequence[str] = (),
    where: Optional[str] = None,
    warn: Callable[[str], None] = stderr_line,
) -> Dict[str, torch.Tensor]:
    """The drafter tensors of the safetensors `files` (shards of one set of weights, never unpickled), checked by
    `check_tensors`: first the headers (shapes and dtypes, no tensor loaded), then the values. `unused` tensors
    are not loaded. Errors name the file (`where` for the set as a whole)."""
    from safetensors import SafetensorError, safe_open

    headers = {}
    for path in files:
        try:
            with safe_open(path, "pt") as f:
                for key in f.keys():
                    if key in headers:
                        raise error(f"{path}: tensor {key} is stored twice")
                    part = f.get_slice(key)
                    headers[key] = TensorInfo(tuple(part.get_shape()), _DTYPES.get(part.get_dtype(), part.get_dtype()))
        except (SafetensorError, OSError) as e:
            raise error(f"{path} is not a readable safetensors file: {e}") from None
    where = where or (files[0] if len(files) == 1 else ", ".join(files))
    check_tensors(cfg, headers, where, error, unused, warn=lambda _: None)
    tensors = {}
    for path in files:
        with safe_open(path, "pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys() if key not in unused})
    check_tensors(cfg, tensors, where, error, unused, warn)
    return tensors


# safetensors' dtype names -> torch's (others are kept as their name: never a weight dtype)
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


# ---------------------------------------------------------------- the frozen tensors, read from the target


FROZEN_NAMES = {
    "embed_tokens": (
        "model.embed_tokens.weight",
        "model.language_model.embed_tokens.weight",
        "language_model.model.embed_tokens.weight",
    ),
    "lm_head": ("lm_head.weight", "language_model.lm_head.weight"),
    "target_norm": ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight"),
}


def target_tensor_files(target_path: str) -> Dict[str, str]:
    """tensor name -> the safetensors file of the target at `target_path` that holds it (headers only)."""
    from safetensors import safe_open

    index_path = os.path.join(target_path, "model.safetensors.index.json")
    if os.path.exists(index_path):
        weight_map = read_json_object(index_path, "a safetensors index", WEIGHTS_INDEX_SCHEMA)["weight_map"]
        return {k: os.path.join(target_path, v) for k, v in weight_map.items()}
    single = os.path.join(target_path, "model.safetensors")
    if not os.path.exists(single):
        raise FileNotFoundError(f"{target_path} has neither model.safetensors nor model.safetensors.index.json")
    with safe_open(single, "pt") as f:
        return {k: single for k in f.keys()}


def target_parameters(target_path: str) -> int:
    """The parameter count of the target at `target_path`, from its safetensors headers (no tensor loaded)."""
    from safetensors import safe_open

    files = sorted(set(target_tensor_files(target_path).values()))
    total = 0
    for path in files:
        with safe_open(path, "pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return total


def check_drafter_fits_target(cfg: DrafterConfig, target_path: str) -> None:
    """Refuse, before anything is built, a drafter whose sizes (copied from the target's config.json) imply more
    trainable parameters than the target's own weights hold: a drafter is a fraction of its target, and a config
    claiming intermediate_size 10^12 would otherwise allocate until the allocator fails."""
    implied, present = trainable_parameters(cfg), target_parameters(target_path)
    if implied > present:
        raise ValueError(
            f"{target_path}: a drafter of {implied:,} trainable parameters (its config.json's sizes: hidden_size "
            f"{cfg.hidden_size}, intermediate_size {cfg.intermediate_size}, {cfg.num_attention_heads} heads, "
            f"{cfg.num_layers} drafter layers) is larger than the target, whose safetensors hold {present:,}: "
            f"check the target's config.json, or use fewer drafter layers (model.num_layers)"
        )


def load_frozen_tensors(
    target_path: str, dtype: torch.dtype = torch.float32, norm_kind: Optional[str] = None
) -> Dict[str, torch.Tensor]:
    """Read only embed_tokens, lm_head and the final norm from the target's safetensors (never the
    whole target). lm_head falls back to embed_tokens for tied embeddings; the final norm is returned
    as its effective weight (1 + w when zero-centred), in fp32; embed_tokens and lm_head in `dtype`.
    `norm_kind` is the kind extraction measured (the store manifest's `final_norm.kind`); without it
    the model type decides."""
    from safetensors import safe_open

    config = read_json_object(os.path.join(target_path, "config.json"), "a model config (a JSON object)",
                              Obj({}, optional={"text_config": OBJECT}))
    text_config = config.get("text_config", config)
    where = target_tensor_files(target_path)
    out = {}
    for name, candidates in FROZEN_NAMES.items():
        key = next((c for c in candidates if c in where), None)
        if (
            key is None
            and name == "lm_head"
            and (text_config.get("tie_word_embeddings") or config.get("tie_word_embeddings"))
        ):
            out[name] = out["embed_tokens"]
            continue
        if key is None:
            raise ValueError(f"{target_path}: none of {candidates} found for the target's {name} (not a whole target)")
        with safe_open(where[key], "pt") as f:
            out[name] = f.get_tensor(key).to(torch.float32 if name == "target_norm" else dtype)
    if norm_kind is None:
        model_type = text_config.get("model_type", config.get("model_type", ""))
        norm_kind = "rmsnorm_zero_centred" if model_type in ZERO_CENTRED_NORM_MODELS else "rmsnorm"
    out["target_norm"] = final_norm_weight(out["target_norm"].float(), norm_kind)  # [H]: fp32 whatever `dtype`
    return out
