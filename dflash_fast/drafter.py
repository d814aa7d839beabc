"""The DFlash drafter (SPEC §3-5): fc over the K tapped layers, N Qwen3-style layers
attending to [ctx ; block], the target's frozen embedding, final norm and lm_head.

    hidden [R, T, K, H_t] --fc_concat--> ctx [R, T, H]
    block ids [R, A*B] --embed--> x --N layers (q from x; k/v from [ctx ; x])--> x
    x --norm, lm_head, loss vs teacher at p-1--> loss, argmaxes

DSpark (SPEC §8, `markov_rank > 0` or `confidence_head`): the same backbone plus the heads of
`dflash_fast.dspark`; the Markov bias rides in the lm_head loss (eager.Markov), the confidence head is
trained against the acceptance rate the loss returns.

The three hot ops go through `dflash_fast.ops`; everything else is plain torch.
"""
import dataclasses
import math
import os
import sys
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Type, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from dflash_fast import ops
from dflash_fast.dspark import MARKOV_HEAD_TYPES, ConfidenceHead, MarkovHead, head_shapes
from dflash_fast.eager import DENSE_KINDS, WINDOW_RULES, DPace, Markov, Teacher, check_window, needs_last, rms_norm
from dflash_fast.errors import OBJECT, WEIGHTS_INDEX_SCHEMA, Obj, is_int, read_json_object
from dflash_fast.store import final_norm_weight

LAYER_KINDS = ("full", "sliding")
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
# Sizes and counts of a DrafterConfig and the least value each may take: 1 for the sizes, 2 for the block (the given
# token and one to draft), 0 for the mask token (a token id).
SIZE_FIELDS = {
    **dict.fromkeys(("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                     "vocab_size", "target_hidden_size", "target_num_layers", "max_position_embeddings",
                     "num_layers"), 1),
    "block_size": 2,
    "mask_token_id": 0,
}
# The block is the one size no weight backs (every slot of every anchor is a query row): published DFlash drafters use
# 16 and no verifier step accepts hundreds of drafted tokens, so a larger block is a typo or a forged file.
MAX_BLOCK_SIZE = 256


@dataclasses.dataclass
class DrafterConfig:
    """Architecture of the drafter; built from the target's config by `from_target`."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    layer_ids: List[int]  # target layer ids tapped (SPEC §1 convention: HF hidden_states[id + 1])
    target_num_layers: int
    target_hidden_size: int
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_parameters: Dict = dataclasses.field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 32768
    num_layers: int = 5
    block_size: int = 16
    layer_types: Optional[List[str]] = None  # per layer "full" | "sliding"; None = all full
    sliding_window: Optional[int] = None
    window_from: str = "anchor"  # a sliding window's keys end at the anchor (SPEC §4) or at each query (the engines)
    causal_in_block: Union[bool, List[bool]] = False  # one flag for every layer, or one per layer (kept as a list)
    target_model_type: str = ""
    # DSpark (SPEC §8); the defaults are DFlash.
    sample_from_anchor: bool = False  # slot j predicts the token at a + j + 1 (slot 0 included)
    markov_rank: int = 0  # r of the Markov bias W2 W1[prev]; 0 = no Markov head
    markov_head_type: str = "vanilla"  # vanilla | gated | rnn
    confidence_head: bool = False
    confidence_head_with_markov: bool = True  # the confidence head reads [hidden, W1[prev]], not hidden alone

    def __post_init__(self):
        problems = value_problems(dataclasses.asdict(self))
        if problems:
            raise ValueError("; ".join(problems))
        if self.layer_types is None:
            self.layer_types = ["full"] * self.num_layers
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} drafter layers")
        for kind in self.layer_types:
            if kind not in LAYER_KINDS:
                raise ValueError(f"drafter layer kind {kind!r} is not one of {LAYER_KINDS}")
        if "sliding" in self.layer_types and not self.sliding_window:
            raise ValueError("a 'sliding' drafter layer needs sliding_window > 0")
        if "sliding" in self.layer_types:
            check_window(self.sliding_window, self.window_from, self.block_size)
        if isinstance(self.causal_in_block, bool):
            self.causal_in_block = [self.causal_in_block] * self.num_layers
        self.causal_in_block = list(self.causal_in_block)
        if len(self.causal_in_block) != self.num_layers or not all(isinstance(c, bool) for c in self.causal_in_block):
            raise ValueError(
                f"causal_in_block={self.causal_in_block!r}: give true/false, or one true/false per drafter layer "
                f"({self.num_layers})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{self.num_attention_heads} query heads are not a multiple of {self.num_key_value_heads} kv heads"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask token id {self.mask_token_id} is outside the embedding (0..{self.vocab_size - 1})")
        if self.markov_rank < 0 or self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(
                f"markov_rank={self.markov_rank} must be >= 0 and markov_head_type={self.markov_head_type!r} one of "
                f"{MARKOV_HEAD_TYPES}"
            )
        if self.confidence_head and self.confidence_head_with_markov and not self.markov_rank:
            raise ValueError("confidence_head_with_markov needs the Markov head: set markov_rank > 0 or the flag false")

    @property
    def first_slot(self) -> int:
        """The first slot that predicts a token: 0 with sample_from_anchor, else 1 (slot 0 is given)."""
        return 0 if self.sample_from_anchor else 1

    @property
    def num_tapped(self) -> int:
        return len(self.layer_ids)

    @classmethod
    def from_target(cls, target_config, layer_ids: List[int], mask_token_id: int, **options) -> "DrafterConfig":
        """Copy sizes, RoPE and eps from an HF target config (text sub-config of multimodal ones)."""
        tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        rope = dict(
            getattr(tc, "rope_parameters", None)
            or {"rope_type": "default", "rope_theta": getattr(tc, "rope_theta", 10000.0)}
        )
        if getattr(tc, "partial_rotary_factor", None) is not None:
            rope.setdefault("partial_rotary_factor", tc.partial_rotary_factor)
        intermediate = getattr(tc, "intermediate_size", None) or 4 * tc.hidden_size
        return cls(
            hidden_size=tc.hidden_size,
            num_attention_heads=tc.num_attention_heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
            head_dim=head_dim,
            intermediate_size=intermediate,
            vocab_size=tc.vocab_size,
            layer_ids=list(layer_ids),
            target_num_layers=tc.num_hidden_layers,
            target_hidden_size=tc.hidden_size,
            mask_token_id=mask_token_id,
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            rope_parameters=rope,
            max_position_embeddings=getattr(tc, "max_position_embeddings", 32768),
            target_model_type=getattr(tc, "model_type", ""),
            **options,
        )

    def to_dict(self) -> Dict:
        return dataclasses.asdict(self)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def value_problems(values: Mapping) -> List[str]:
    """What is wrong with the drafter fields in `values` (a DrafterConfig's, or an export's architecture with the
    same names), one `field=value is not ...` line each: the one home of the drafter's value rules, for configs
    built from a target, read from a checkpoint marker or from an export."""
    problems = [
        f"{field}={values[field]!r} is not an integer >= {least}"
        for field, least in SIZE_FIELDS.items()
        if field in values and (not is_int(values[field]) or values[field] < least)
    ]
    block = values.get("block_size")
    if is_int(block) and block > MAX_BLOCK_SIZE:
        problems.append(f"block_size={block} is beyond {MAX_BLOCK_SIZE} (MAX_BLOCK_SIZE: no weight bounds the block)")
    eps = values.get("rms_norm_eps", 1e-6)
    if not _is_number(eps) or not 0 < eps < 1:
        problems.append(f"rms_norm_eps={eps!r} is not a number in (0, 1)")
    window = values.get("sliding_window")
    if window is not None and (not is_int(window) or window < 1):
        problems.append(f"sliding_window={window!r} is not an integer >= 1")
    window_from = values.get("window_from", "anchor")
    if window_from not in WINDOW_RULES:
        problems.append(f"window_from={window_from!r} is not one of {WINDOW_RULES}")
    rank, head = values.get("markov_rank", 0), values.get("markov_head_type", "vanilla")
    if not is_int(rank) or rank < 0:
        problems.append(f"markov_rank={rank!r} is not an integer >= 0")
    if not isinstance(head, str):
        problems.append(f"markov_head_type={head!r} is not a string")
    rope = values.get("rope_parameters", {})
    if not isinstance(rope, dict):
        problems.append(f"rope_parameters={rope!r} is not an object")
    else:
        problems += rope_problems(rope)
    return problems


def rope_problems(rope: Mapping) -> List[str]:
    """RoPE parameters that would give NaN, infinite or meaningless rotations: every number finite, rope_theta and
    the scaling factors > 0, partial_rotary_factor in (0, 1]."""
    problems = [f"rope_parameters.{k}={v!r} is not a finite number"
                for k, v in rope.items() if isinstance(v, float) and not math.isfinite(v)]
    theta = rope.get("rope_theta", 10000.0)
    if not _is_number(theta) or theta <= 0:
        problems.append(f"rope_parameters.rope_theta={theta!r} is not a number > 0")
    for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "low_freq_factor",
                "high_freq_factor", "attention_factor"):
        if key in rope and rope[key] is not None and (not _is_number(rope[key]) or rope[key] <= 0):
            problems.append(f"rope_parameters.{key}={rope[key]!r} is not a number > 0")
    partial = rope.get("partial_rotary_factor", 1.0)
    if not _is_number(partial) or not 0 < partial <= 1:
        problems.append(f"rope_parameters.partial_rotary_factor={partial!r} is not a number in (0, 1]")
    return problems


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


# ---------------------------------------------------------------- the drafter's weights read from a file


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


def resolve_mask_token_id(vocab_size: int, mask_token_id: Optional[int] = None, tokenizer=None) -> int:
    """`--mask-token-id`, else the tokenizer's mask token, else the last embedding row the tokenizer
    does not use (targets such as Qwen3 pad their embedding beyond the tokenizer)."""
    if mask_token_id is None and tokenizer is not None and tokenizer.mask_token_id is not None:
        mask_token_id = tokenizer.mask_token_id
    if mask_token_id is None and tokenizer is not None and len(tokenizer) < vocab_size:
        mask_token_id = vocab_size - 1
    if mask_token_id is None:
        raise ValueError(
            f"no mask token: the tokenizer has no mask token and uses all {vocab_size} embedding rows; "
            f"pass --mask-token-id"
        )
    if not 0 <= mask_token_id < vocab_size:
        raise ValueError(f"mask token id {mask_token_id} is outside the target embedding (0..{vocab_size - 1})")
    return mask_token_id


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Rope(nn.Module):
    """RoPE over the first `rotary_dim` channels of each head (partial_rotary_factor), HF's rotate-half layout."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        params = cfg.rope_parameters
        rope_type = params.get("rope_type", params.get("type", "default"))
        self.rotary_dim = int(cfg.head_dim * params.get("partial_rotary_factor", 1.0))
        if rope_type == "default":
            dim = self.rotary_dim
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            scaling = 1.0
        else:
            from transformers import Qwen3Config
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            hf = Qwen3Config(
                hidden_size=cfg.hidden_size,
                num_attention_heads=cfg.num_attention_heads,
                head_dim=self.rotary_dim,
                max_position_embeddings=cfg.max_position_embeddings,
                rope_parameters=dict(params, partial_rotary_factor=1.0),
            )
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scaling = scaling

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [...] -> cos, sin [..., 1, rotary_dim] (broadcast over heads)."""
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.scaling).to(dtype)[..., None, :], (emb.sin() * self.scaling).to(dtype)[..., None, :]

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., heads, D] rotated on its first rotary_dim channels."""
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.hq * d, bias=False)
        self.k_proj = nn.Linear(h, self.hkv * d, bias=False)
        self.v_proj = nn.Linear(h, self.hkv * d, bias=False)
        self.o_proj = nn.Linear(self.hq * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, rope: Rope, cos_sin):
        """x [R, S, H] -> k, v [R, S, Hkv, D]; the same projections serve ctx and block."""
        r, s, _ = x.shape
        k = rope.rotate(self.k_norm(self.k_proj(x).view(r, s, self.hkv, self.d)), *cos_sin)
        return k, self.v_proj(x).view(r, s, self.hkv, self.d)

    def forward(self, x, ctx, rope: Rope, blk_cos_sin, ctx_cos_sin, attn: Dict) -> torch.Tensor:
        r, q_len, _ = x.shape
        q = rope.rotate(self.q_norm(self.q_proj(x).view(r, q_len, self.hq, self.d)), *blk_cos_sin)
        k_blk, v_blk = self.kv(x, rope, blk_cos_sin)
        k_ctx, v_ctx = self.kv(ctx, rope, ctx_cos_sin)  # ctx gets no input_layernorm (SPEC §4)
        out = ops.anchored_attention(q, k_ctx, v_ctx, k_blk, v_blk, scale=self.d**-0.5, **attn)
        return self.o_proj(out.reshape(r, q_len, self.hq * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.window = cfg.sliding_window if cfg.layer_types[index] == "sliding" else None
        self.window_from = cfg.window_from
        self.causal_in_block = cfg.causal_in_block[index]

    def forward(self, x, ctx, rope, blk_cos_sin, ctx_cos_sin, attn: Dict) -> torch.Tensor:
        attn = dict(attn, window=self.window, window_from=self.window_from, causal_in_block=self.causal_in_block)
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope, blk_cos_sin, ctx_cos_sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


def position_weights(block_size: int, gamma: float, sample_from_anchor: bool = False) -> torch.Tensor:
    """SPEC §5: w_0 = 0, w_j = exp(-(j - 1) / gamma) -> [B]; with sample_from_anchor (SPEC §8) every slot
    predicts and the decay starts at slot 0: w_j = exp(-j / gamma)."""
    j = torch.arange(block_size, dtype=torch.float32)
    if sample_from_anchor:
        return torch.exp(-j / gamma)
    return torch.where(j >= 1, torch.exp(-(j - 1) / gamma), torch.zeros(()))


class Targets(NamedTuple):
    """Where every slot's teacher lives. All [R, A, B]."""

    slot_mask: torch.Tensor  # bool: trained and scored (slot predicts, valid anchor, in row, same document, loss_mask)
    position: torch.Tensor  # the predicted position (p = a + j, or p + 1 with sample_from_anchor), clamped into the row
    teacher_row: torch.Tensor  # the predicted position - 1, clamped into the row
    prev_position: torch.Tensor  # DSpark's previous token: predicted position - 1, slot 0 its own (>= a), in the row


def slot_targets(batch: Dict[str, torch.Tensor], block_size: int, sample_from_anchor: bool = False) -> Targets:
    """SPEC §5: slot j of the block at anchor a sits at p = a + j, predicts the token at p and is scored against
    the teacher at p - 1; slot 0 (the given token) never trains. With sample_from_anchor (SPEC §8) slot j
    predicts the token at p + 1, slot 0 included, against the teacher at p. The masks apply to the predicted
    position."""
    anchors, valid = batch["anchors"], batch["anchor_valid"]
    t = batch["input_ids"].shape[1]
    j = torch.arange(block_size, device=anchors.device)
    p = anchors[:, :, None] + j + int(sample_from_anchor)
    in_row = p.clamp(max=t - 1)
    gather = lambda src: src.gather(1, in_row.flatten(1)).view(in_row.shape)
    anchor_doc = batch["document_ids"].gather(1, anchors)[:, :, None]
    mask = (
        (j >= (0 if sample_from_anchor else 1))
        & valid[:, :, None]
        & (p < t)
        & (gather(batch["document_ids"]) == anchor_doc)
        & gather(batch["loss_mask"].bool())
    )
    prev = torch.maximum(p - 1, anchors[:, :, None]).clamp(max=t - 1)
    return Targets(mask, in_row, (p - 1).clamp(0, t - 1), prev)


def teacher_index(targets: Targets, seq_len: int) -> torch.Tensor:
    """[R*A*B] row of last.flatten(0, 1) ([R*T, H]) each slot is scored against: its position p - 1 in its row.
    Overlapping blocks share these rows, so the loss computes each teacher row's logits once."""
    r = targets.teacher_row.shape[0]
    offsets = torch.arange(r, device=targets.teacher_row.device)[:, None, None] * seq_len
    return (targets.teacher_row + offsets).flatten()


def gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [R, T, ...] at row positions rows [R, A, B] -> [R*A*B, ...]."""
    r, t = x.shape[:2]
    idx = rows.reshape(r, -1)
    return x.gather(1, idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])).flatten(0, 1)


class DrafterOutput(NamedTuple):
    loss: torch.Tensor
    kl: Optional[torch.Tensor]
    draft_argmax: torch.Tensor  # [R, A, B]
    teacher_argmax: torch.Tensor  # [R, A, B] (the teacher's argmax at the predicted position - 1)
    slot_mask: torch.Tensor  # [R, A, B] bool
    alpha: torch.Tensor  # [R, A, B] fp32: each slot's acceptance estimate sum_v min(p_v, q_v) (eager.LossOutput)
    first_slot: int = 1  # the first slot that predicts (DrafterConfig.first_slot)
    confidence_loss: Optional[torch.Tensor] = None  # DSpark: the confidence BCE (before confidence_alpha)
    confidence: Optional[torch.Tensor] = None  # DSpark: [R, A, B] the confidence head's probability (no gradient)


class DFlashDrafter(nn.Module):
    """Trainable: fc, hidden_norm, layers, norm (and DSpark's markov_head, confidence_head). Frozen buffers:
    embed_tokens, lm_head, target_norm."""

    def __init__(self, cfg: DrafterConfig, frozen_dtype: torch.dtype = torch.float32):
        """`frozen_dtype`: the dtype of embed_tokens and lm_head ([V, H] each); target_norm stays fp32."""
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_tapped * cfg.target_hidden_size, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.rope = Rope(cfg)
        # Zeros of the right shape and dtype that take no memory (one element, expanded) until set_frozen gives the
        # target's: a config read from a file builds nothing its weights do not back.
        placeholder = torch.zeros((), dtype=frozen_dtype).expand(cfg.vocab_size, h)
        self.register_buffer("embed_tokens", placeholder, persistent=False)
        self.register_buffer("lm_head", placeholder, persistent=False)
        self.register_buffer(
            "target_norm", torch.ones(h), persistent=False
        )  # effective weight (1 + w for zero-centred norms)
        self.markov_head = (
            MarkovHead(cfg.vocab_size, cfg.markov_rank, h, cfg.markov_head_type) if cfg.markov_rank else None
        )
        self.confidence_head = (
            ConfidenceHead(h + (cfg.markov_rank if cfg.confidence_head_with_markov else 0))
            if cfg.confidence_head
            else None
        )
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
        if self.markov_head is not None:
            self.markov_head.reset_parameters(std)

    def load_trainable(self, weights: Dict[str, torch.Tensor]) -> None:
        """Copy `weights` (name -> tensor, passed by check_tensors) into the trainable parameters."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(weights[name].to(p.dtype))

    def set_frozen(self, embed_tokens: torch.Tensor, lm_head: torch.Tensor, target_norm: torch.Tensor):
        """Copy the target's frozen tensors in (shapes [V, H], [V, H], [H])."""
        for name, value in (("embed_tokens", embed_tokens), ("lm_head", lm_head), ("target_norm", target_norm)):
            buf = getattr(self, name)
            if tuple(value.shape) != tuple(buf.shape):
                raise ValueError(
                    f"target {name} has shape {tuple(value.shape)}, the drafter expects {tuple(buf.shape)}"
                )
            setattr(self, name, value.detach().to(device=buf.device, dtype=buf.dtype))

    def context(self, hidden: torch.Tensor, noise_std: float = 0.0, seed: int = 0) -> torch.Tensor:
        """hidden [R, T, K, H_t] -> ctx [R, T, H] = hidden_norm(fc(concat_k hidden)) (SPEC §3)."""
        r, t, k, h_t = hidden.shape
        ctx = ops.fc_concat(
            hidden.reshape(r * t, k, h_t),
            self.fc.weight,
            self.hidden_norm.weight,
            self.config.rms_norm_eps,
            noise_std,
            seed,
        )
        return ctx.view(r, t, -1)

    def block_states(
        self, ctx, ctx_positions, input_ids_at_anchor, anchor_positions, anchors, anchor_valid, document_ids
    ):
        """The N layers over every block. ctx [R, T, H]; ctx_positions [R, T] (RoPE positions);
        input_ids_at_anchor, anchor_positions, anchors, anchor_valid [R, A]; document_ids [R, T]
        -> pre-norm states [R, A*B, H]."""
        cfg = self.config
        r, a = anchors.shape
        b = cfg.block_size
        ids = torch.full((r, a, b), cfg.mask_token_id, dtype=torch.long, device=anchors.device)
        ids[:, :, 0] = input_ids_at_anchor
        x = F.embedding(ids.view(r, a * b), self.embed_tokens).to(ctx.dtype)
        blk_pos = (anchor_positions[:, :, None] + torch.arange(b, device=anchors.device)).view(r, a * b)
        blk_cs, ctx_cs = self.rope.cos_sin(blk_pos, x.dtype), self.rope.cos_sin(ctx_positions, x.dtype)
        attn = dict(anchors=anchors, anchor_valid=anchor_valid, document_ids=document_ids, block_size=b)
        for layer in self.layers:
            x = layer(x, ctx, self.rope, blk_cs, ctx_cs, attn)
        return x

    def batch_states(self, batch: Dict[str, torch.Tensor], noise_std: float = 0.0, seed: int = 0) -> torch.Tensor:
        """Pre-norm block states [R, A*B, H] of a collated batch (keys as in dflash_fast.batches): the context
        from the tapped hidden states, then the N layers over every anchor's block."""
        anchors = batch["anchors"]
        return self.block_states(
            self.context(batch["hidden"], noise_std, seed),
            batch["position_ids"],
            batch["input_ids"].gather(1, anchors),
            batch["position_ids"].gather(1, anchors),
            anchors,
            batch["anchor_valid"],
            batch["document_ids"],
        )

    def forward(
        self,
        batch: Dict[str, torch.Tensor],
        loss_kind: str = "kl",
        gamma: float = 7.0,
        noise_std: float = 0.0,
        seed: int = 0,
        weighting: str = "decay",
        dpace_alpha: float = 0.5,
        confidence_alpha: float = 1.0,
    ) -> DrafterOutput:
        """Training forward on a collated batch (keys as in dflash_fast.batches).

        weighting: "decay" (SPEC §5 position weights with `gamma`) or "dpace" (D-PACE with `dpace_alpha`,
        computed inside the loss from the drafter's confidence). DSpark (SPEC §8): loss = the main loss on the
        Markov-biased logits + confidence_alpha x the confidence head's BCE against the acceptance rate,
        weighted with the decay whatever `weighting` is.
        """
        cfg = self.config
        anchors = batch["anchors"]
        r, a = anchors.shape
        b = cfg.block_size
        x = self.batch_states(batch, noise_std, seed)
        targets = slot_targets(batch, b, cfg.sample_from_anchor)
        dpace = DPace(dpace_alpha, b) if weighting == "dpace" else None
        decay = position_weights(b, gamma, cfg.sample_from_anchor).to(x.device) * targets.slot_mask
        weights = targets.slot_mask.float() if dpace else decay
        n = r * a * b
        if self.confidence_head is not None and loss_kind not in DENSE_KINDS:
            raise ValueError(
                f"the confidence head learns the acceptance rate sum_v min(q_v, p_v) against the full teacher: loss "
                f"kind {loss_kind!r} has none; use one of {DENSE_KINDS} (a store with `last`)"
            )
        markov, confidence_logit = self.dspark_heads(x, gather_rows(batch["input_ids"], targets.prev_position))
        stored_argmax = (
            gather_rows(batch["teacher_topk_ids"], targets.teacher_row)[:, 0] if "teacher_topk_ids" in batch else None
        )
        if needs_last(loss_kind, stored_argmax is not None):
            if "last" not in batch:
                raise ValueError(
                    f"loss kind {loss_kind!r} needs `last` in the store; use ce or kl_topk with a --no-last store"
                )
            teacher = Teacher(
                last=batch["last"].flatten(0, 1).to(x.dtype),
                final_norm_weight=self.target_norm.to(x.dtype),
                index=teacher_index(targets, batch["last"].shape[1]),
            )
        elif loss_kind == "ce":
            teacher = Teacher(labels=stored_argmax)
        elif loss_kind == "ce_data":
            teacher = Teacher(labels=gather_rows(batch["input_ids"], targets.position))
        elif loss_kind == "kl_topk":
            teacher = Teacher(
                topk_ids=gather_rows(batch["teacher_topk_ids"], targets.teacher_row),
                topk_logits=gather_rows(batch["teacher_topk_logits"], targets.teacher_row),
                topk_lse=gather_rows(batch["teacher_lse"], targets.teacher_row),
            )
        else:
            raise ValueError(f"unknown loss kind {loss_kind!r}")
        out = ops.lm_head_loss(
            x.reshape(n, -1),
            self.norm.weight,
            self.lm_head.to(x.dtype),
            weights.reshape(n),
            loss_kind,
            targets.slot_mask.sum(),
            cfg.rms_norm_eps,
            teacher,
            dpace,
            markov=markov,
        )
        teacher_argmax = stored_argmax if stored_argmax is not None and loss_kind == "ce_data" else out.teacher_argmax
        loss, confidence_loss, confidence = out.loss, None, None
        if confidence_logit is not None:
            logit = confidence_logit.float()
            bce = F.binary_cross_entropy_with_logits(logit, out.alpha, reduction="none")
            confidence_loss = (bce * decay.reshape(n)).sum() / targets.slot_mask.sum().clamp(min=1)
            loss = loss + confidence_alpha * confidence_loss
            confidence = torch.sigmoid(logit.detach()).view(r, a, b)
        return DrafterOutput(
            loss,
            out.kl,
            out.draft_argmax.view(r, a, b),
            teacher_argmax.view(r, a, b),
            targets.slot_mask,
            out.alpha.view(r, a, b),
            cfg.first_slot,
            confidence_loss,
            confidence,
        )

    def dspark_heads(self, x: torch.Tensor, prev_ids: torch.Tensor) -> Tuple[Optional[Markov], Optional[torch.Tensor]]:
        """DSpark's heads on pre-norm block states x [R, A*B, H] with the previous tokens prev_ids [R*A*B]
        (Targets.prev_position's) -> (the Markov bias as the loss takes it, or None; confidence logits [R*A*B]
        or None). Both heads read the lm_head's input norm(x)."""
        if self.markov_head is None and self.confidence_head is None:
            return None, None
        r, b = x.shape[0], self.config.block_size
        hidden = self.norm(x).view(r, -1, b, x.shape[-1])
        markov, feature = None, None
        if self.markov_head is not None:
            e, feature = self.markov_head(prev_ids.view(hidden.shape[:-1]), hidden)
            markov = Markov(e.reshape(-1, e.shape[-1]).to(x.dtype), self.markov_head.markov_w2.weight.to(x.dtype))
        if self.confidence_head is None:
            return markov, None
        features = torch.cat([hidden, feature], dim=-1) if self.config.confidence_head_with_markov else hidden
        return markov, self.confidence_head(features).reshape(-1)

    def block_logits(self, batch: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Materialised fp32 logits of every slot [R, A*B, V], Markov bias (from the ground-truth previous tokens)
        included, and the confidence logits [R, A*B] or None: for the export gate, not for training."""
        x = self.batch_states(batch)
        targets = slot_targets(batch, self.config.block_size, self.config.sample_from_anchor)
        markov, confidence = self.dspark_heads(x, gather_rows(batch["input_ids"], targets.prev_position))
        logits = F.linear(self.norm(x), self.lm_head.to(x.dtype))
        if markov is not None:
            logits = logits + F.linear(markov.e, markov.w2).view(logits.shape)
        return logits.float(), None if confidence is None else confidence.float().view(x.shape[:2])

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, anchor_token: int, with_confidence: bool = False):
        """Inference for one sequence: hidden [T, K, H_t] of positions 0..T-1 (all the target has
        processed), anchor token at position T -> greedy guesses for positions T+1..T+B-1 [B-1]
        (T+1..T+B [B] with sample_from_anchor). With a Markov head the block is drafted slot by slot,
        each slot's bias from the token drafted for the position before its own (the anchor's token first).
        with_confidence (a drafter with a confidence head): (guesses, the head's acceptance probability of
        each guess [same length])."""
        t = hidden.shape[0]
        dev = hidden.device
        ctx = self.context(hidden[None].to(self.fc.weight.dtype))
        anchors = torch.tensor([[t]], device=dev)
        one_document = torch.zeros(1, t, dtype=torch.long, device=dev)
        x = self.block_states(
            ctx,
            torch.arange(t, device=dev)[None],
            torch.tensor([[anchor_token]], device=dev),
            anchors,
            anchors,
            torch.ones(1, 1, dtype=torch.bool, device=dev),
            one_document,
        )
        hidden_normed = self.norm(x[0])  # [B, H]
        logits = F.linear(hidden_normed, self.lm_head.to(x.dtype))
        first = self.config.first_slot
        features = hidden_normed[first:]
        if self.markov_head is None:
            guesses = logits[first:].argmax(-1)
        else:
            head, shift = self.markov_head, int(self.config.sample_from_anchor)
            tokens = [torch.tensor(anchor_token, device=dev)]  # tokens[m]: the token at position T + m
            state, e_prevs = hidden_normed.new_zeros(head.rank), []
            for k in range(self.config.block_size):
                e_prev = head.markov_w1(tokens[max(k + shift - 1, 0)]).to(x.dtype)
                e, state = head.step(e_prev, hidden_normed[k], state)
                if k >= first:
                    tokens.append((logits[k] + head.markov_w2(e)).argmax())
                    e_prevs.append(e_prev)
            guesses = torch.stack(tokens[1:])
            if self.config.confidence_head_with_markov:
                features = torch.cat([features, torch.stack(e_prevs)], dim=-1)
        if not with_confidence:
            return guesses
        return guesses, torch.sigmoid(self.confidence_head(features).float())


def slot_metrics(out: DrafterOutput) -> Dict[str, torch.Tensor]:
    """Sums for SPEC §6 metrics (reduce across ranks, then divide): acc_hits/acc_count [B] per slot,
    alpha_sum [B] (acceptance estimates of the valid slots, over acc_count), tau_sum (sum over valid blocks
    of 1 + leading matches), blocks (valid block count)."""
    match = (out.draft_argmax == out.teacher_argmax) & out.slot_mask
    first = out.first_slot
    valid_block = out.slot_mask[..., first]  # an anchor is eligible only if its first predicting slot trains (SPEC §3)
    leading = match[..., first:].long().cumprod(-1).sum(-1)
    return {
        "acc_hits": match.flatten(0, 1).sum(0).float(),
        "acc_count": out.slot_mask.flatten(0, 1).sum(0).float(),
        "alpha_sum": (out.alpha * out.slot_mask).flatten(0, 1).sum(0).float(),
        "tau_sum": ((1 + leading) * valid_block).sum().float(),
        "blocks": valid_block.sum().float(),
    }


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


def build_drafter(
    target_path: str,
    layer_ids: List[int],
    mask_token_id: Optional[int] = None,
    norm_kind: Optional[str] = None,
    frozen_dtype: torch.dtype = torch.float32,
    **options,
) -> DFlashDrafter:
    """A fresh drafter for the target at `target_path` with its frozen tensors loaded in `frozen_dtype`
    (`norm_kind`: see load_frozen_tensors). Trainable weights are fp32 whatever `frozen_dtype` is;
    loading the [V, H] embedding and lm_head straight in the compute dtype spares every rank an fp32 copy."""
    from transformers import AutoConfig, AutoTokenizer

    target_config = AutoConfig.from_pretrained(target_path)
    vocab = (target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config).vocab_size
    tokenizer = None
    if mask_token_id is None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(target_path)
        except (OSError, ValueError):
            tokenizer = None
    cfg = DrafterConfig.from_target(
        target_config, layer_ids, resolve_mask_token_id(vocab, mask_token_id, tokenizer), **options
    )
    check_drafter_fits_target(cfg, target_path)
    drafter = DFlashDrafter(cfg, frozen_dtype)
    drafter.set_frozen(**load_frozen_tensors(target_path, frozen_dtype, norm_kind=norm_kind))
    return drafter
