"""fp8 packing of a store's `hidden` and `last` (`--dtype fp8`, schema version 2).

An fp8 value is `x / scale` rounded to e4m3 with one fp32 scale per token and layer, `scale = absmax(x) / 448`,
stored beside the field as `hidden_scale [n, K]` and `last_scale [n]` (SCALE_FIELDS); `dequantize_fp8` gives back
`q * scale` (the loader does this on read, to FP8_READ_DTYPE). Half the bytes of bf16.
"""
from typing import Tuple

import torch

FP8 = "float8_e4m3fn"
FP8_MAX = 448.0  # largest finite e4m3fn value
# fp8 stores hold each of these fields with a per-token fp32 scale (one per layer for `hidden`).
SCALE_FIELDS = {"hidden": "hidden_scale", "last": "last_scale"}
# What the loader dequantises fp8 to: the bytes a bf16 store would hand the trainer.
FP8_READ_DTYPE = torch.bfloat16


def quantize_fp8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] -> (q [..., H] float8_e4m3fn, scale [...] float32): `scale = absmax / 448` over the last
    dimension, `q = x / scale` rounded to nearest (an all-zero vector gets scale 0 and q 0)."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / FP8_MAX
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (x / divisor[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = FP8_READ_DTYPE) -> torch.Tensor:
    """q [..., H] float8_e4m3fn, scale [...] -> `q * scale` [..., H] in `dtype` (product in fp32, one rounding).

    Error against the quantised x: at most 2^-4 |x| (e4m3's half ulp) + 2^-10 * scale (its subnormals),
    plus the rounding to `dtype` (2^-8 relative for bf16)."""
    return (q.float() * scale.float()[..., None]).to(dtype)
