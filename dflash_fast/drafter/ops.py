"""The switch: each hot op runs its eager twin or its Triton kernel.

    fc_concat(hidden [N, K, H_t], fc_weight [H, K*H_t], norm_weight [H], eps,
              noise_std=0.0, seed=0) -> ctx [N, H]
    anchored_attention(q [R, A*B, Hq, D], k_ctx, v_ctx [R, T, Hkv, D],
              k_blk, v_blk [R, A*B, Hkv, D], anchors [R, A], anchor_valid [R, A],
              document_ids [R, T], block_size, window=None, causal_in_block=False,
              scale=None, window_from="anchor") -> out [R, A*B, Hq, D]
    lm_head_loss(h [N, H], norm_weight [H], lm_head_weight [V, H], weights [N],
              kind, normalizer, eps, teacher: losses.Teacher, dpace: losses.DPace = None,
              markov: losses.Markov = None, topk=0) -> LossOutput
    grouped_dynamic_conv(x [R, A*B, H], delta [R, A*B, taps, H / group], base [taps, H],
              block_size, group_size, residual=None) -> y [R, A*B, H]   (DFlash2, spec.md §9; through `kernel_or`,
              which also gives the same backend's projected_conv: the kernel projection and conv_in in one)

Full semantics in `dflash_fast/drafter/eager.py` (the convolution's in `dflash_fast/drafter/dflash2.py`).
The backend is chosen per op:
`set_backend("triton")`, `set_backend(lm_head_loss="eager")`, the config key
`kernels`, or the env var `DFLASH_KERNELS` (`auto`, or `fc_concat=triton,...`).
`auto` picks Triton on CUDA and eager otherwise.
"""
import contextlib
import importlib
import os
from typing import Dict, Optional

import torch

from dflash_fast.drafter import eager, losses
from dflash_fast.errors import UserError

OPS = ("fc_concat", "anchored_attention", "lm_head_loss", "grouped_dynamic_conv")
BACKENDS = ("eager", "triton", "auto")

_choice: Dict[str, str] = {op: "auto" for op in OPS}


def parse_backends(spec: str) -> Dict[str, str]:
    """'triton' -> every op; 'fc_concat=triton,lm_head_loss=eager' -> those ops."""
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        op, _, backend = part.rpartition("=")
        for name in (op,) if op else OPS:
            if name not in OPS:
                raise ValueError(f"unknown op {name!r} in kernel spec {spec!r}; ops are {OPS}")
            if backend not in BACKENDS:
                raise ValueError(f"unknown backend {backend!r} in kernel spec {spec!r}; backends are {BACKENDS}")
            out[name] = backend
    return out


def set_backend(default: Optional[str] = None, **per_op: str) -> None:
    """set_backend('triton'), set_backend(anchored_attention='eager'), or both."""
    if default is not None:
        _choice.update(parse_backends(default))
    for op, backend in per_op.items():
        _choice.update(parse_backends(f"{op}={backend}"))


if os.environ.get("DFLASH_KERNELS"):
    set_backend(os.environ["DFLASH_KERNELS"])


@contextlib.contextmanager
def backend(spec: str):
    """Run a block with the backends of `spec` (as set_backend), then restore the previous choice."""
    saved = dict(_choice)
    set_backend(spec)
    try:
        yield
    finally:
        _choice.update(saved)


def _triton_impl(op: str, name: Optional[str] = None):
    try:
        module = importlib.import_module(f"dflash_fast.kernels.{op}")
    except ImportError as err:
        raise UserError(
            f"the Triton kernel for {op} cannot be imported ({err}); select the eager backend: "
            f"DFLASH_KERNELS={op}=eager"
        ) from err
    return getattr(module, name or op)


def backend_of(op: str) -> str:
    """The backend `op` runs on now: 'eager' or 'triton'."""
    choice = _choice[op]
    if choice == "auto":
        return "triton" if torch.cuda.is_available() else "eager"
    return choice


def _impl(op: str):
    return _triton_impl(op) if backend_of(op) == "triton" else getattr(eager, op)


def kernel_or(op: str, eager_fn, name: Optional[str] = None):
    """The Triton kernel of `op` (its module's function `name`, default `op`) when its backend is triton, else
    `eager_fn`: for an op whose eager twin lives in its drafter family's module (which imports this one), not in
    eager.py."""
    return _triton_impl(op, name) if backend_of(op) == "triton" else eager_fn


def fc_concat(*args, **kwargs):
    return _impl("fc_concat")(*args, **kwargs)


def anchored_attention(*args, **kwargs):
    return _impl("anchored_attention")(*args, **kwargs)


def lm_head_loss(*args, **kwargs) -> losses.LossOutput:
    return _impl("lm_head_loss")(*args, **kwargs)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The drafter's final norm where the lm_head loss does not fuse it (DFlash2's selector input, spec.md §9): the
    Triton RMSNorm of kernels/_common.py when lm_head_loss runs Triton, else its eager twin. x [..., H] -> [..., H]."""
    if backend_of("lm_head_loss") == "triton":
        return importlib.import_module("dflash_fast.kernels._common").rms_norm(x, weight, eps)
    return eager.rms_norm(x, weight, eps)
