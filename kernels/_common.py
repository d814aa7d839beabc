"""Plumbing every kernel file shares: where kernels run, autotune lists, dot precision, and the RMSNorm passes.

Policy (one for all kernels):
  * `ON_GPU` is decided once, at import, from `torch.cuda.is_available()` and `TRITON_INTERPRET`: on a GPU
    several autotune configs compete; under the interpreter one config with big tiles runs (each program
    iteration costs milliseconds there, and autotuning several configs fails).
  * Dot precision follows torch's own matmul switch, so a kernel rounds like its eager twin: fp32 inputs are
    multiplied in full fp32 ("ieee") unless `torch.backends.cuda.matmul.allow_tf32` is on; 16-bit inputs
    use the tensor cores either way (the setting only affects fp32 operands).

RMSNorm (`rms_norm_forward` / `rms_norm_backward`), the one Triton norm the fc-concat and the lm_head loss
both use; math per row n of x [N, H], statistics in fp32:

    rstd[n] = 1 / sqrt(mean_h x[n, h]^2 + eps)
    xhat[n] = round(x[n] * rstd[n])               (rounded to x.dtype, as the eager twin does)
    y[n]    = w * xhat[n]                        (stored in the requested output dtype)
    backward, for dy[n] = scale[n] * g[n] (scale optional):
    dx[n]   = rstd[n] * (dy[n] w - x[n] rstd[n]^2 mean_h(dy[n] w x[n]))
    dw      = sum_n dy[n] xhat[n]                 (per-program partial sums added on the host: deterministic)

Memory: the forward reads x and writes y [N, H] and rstd [N]; the backward reads x, dy and rstd and
writes dx [N, H] plus one fp32 [H] partial per program.
"""
import os
from typing import List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
ON_GPU = torch.cuda.is_available() and not INTERPRET
MAX_NORM_WIDTH = 32768  # a norm program holds whole rows of x in registers


def autotune_configs(
    names: Sequence[str], gpu: Sequence[tuple], interpreter: tuple, **constants
) -> List[triton.Config]:
    """Autotune candidates: each tuple is (one value per name..., num_warps, num_stages); every candidate of
    `gpu` on a GPU, only `interpreter` under TRITON_INTERPRET=1. `constants` join every config's kwargs."""
    chosen = gpu if ON_GPU else [interpreter]
    return [triton.Config({**dict(zip(names, c[:-2])), **constants}, num_warps=c[-2], num_stages=c[-1]) for c in chosen]


def dot_precision(dtype: torch.dtype) -> str:
    """`input_precision` of tl.dot for operands of `dtype` (see the policy above)."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (sizes persistent and split grids)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def check_device(op: str, *tensors: torch.Tensor) -> None:
    """CPU tensors reach a Triton kernel only through the interpreter."""
    if not INTERPRET and any(t.device.type == "cpu" for t in tensors):
        raise RuntimeError(
            f"the Triton {op} kernel got CPU tensors without TRITON_INTERPRET=1: use the eager "
            f"backend on CPU (DFLASH_KERNELS={op}=eager)"
        )


# ---------------------------------------------------------------- RMSNorm kernels


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, N, H, eps, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr):
    """BLOCK_N rows per program: x [N, H] -> y [N, H] = w * round(x * rstd), rstd [N] fp32."""
    i_n = tl.program_id(0)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_h = tl.arange(0, BLOCK_H)
    m_n = o_n < N
    m_x = m_n[:, None] & (o_h < H)[None, :]
    o_x = o_n.to(tl.int64)[:, None] * H + o_h[None, :]
    b_x = tl.load(x_ptr + o_x, mask=m_x, other=0.0).to(tl.float32)
    b_rstd = tl.rsqrt(tl.where(m_n, tl.sum(b_x * b_x, 1) / H + eps, 1.0))  # padded rows: no 1/0 with eps = 0
    b_w = tl.load(w_ptr + o_h, mask=o_h < H, other=0.0).to(tl.float32)
    b_xhat = (b_x * b_rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + o_x, (b_xhat * b_w[None, :]).to(y_ptr.dtype.element_ty), mask=m_x)
    tl.store(rstd_ptr + o_n, b_rstd, mask=m_n)


@triton.jit
def _rms_norm_bwd_kernel(
    x_ptr,
    w_ptr,
    rstd_ptr,
    dy_ptr,
    scale_ptr,
    dx_ptr,
    dw_ptr,
    N,
    H,
    ROWS_PER_PROGRAM,
    HAS_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Rows [i_p * ROWS_PER_PROGRAM, ...) per program: x, dy [N, H], rstd, scale [N] -> dx [N, H] (x.dtype)
    and this program's partial dw [H] fp32 in dw_ptr[i_p]."""
    i_p = tl.program_id(0)
    o_h = tl.arange(0, BLOCK_H)
    m_h = o_h < H
    b_w = tl.load(w_ptr + o_h, mask=m_h, other=0.0).to(tl.float32)
    b_dw = tl.zeros([BLOCK_H], dtype=tl.float32)
    n_lo = i_p * ROWS_PER_PROGRAM
    n_hi = tl.minimum(n_lo + ROWS_PER_PROGRAM, N)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        m_n = o_n < n_hi
        m_x = m_n[:, None] & m_h[None, :]
        o_x = o_n.to(tl.int64)[:, None] * H + o_h[None, :]
        b_x = tl.load(x_ptr + o_x, mask=m_x, other=0.0).to(tl.float32)
        b_rstd = tl.load(rstd_ptr + o_n, mask=m_n, other=0.0)
        b_dy = tl.load(dy_ptr + o_x, mask=m_x, other=0.0).to(tl.float32)
        if HAS_SCALE:
            b_dy = b_dy * tl.load(scale_ptr + o_n, mask=m_n, other=0.0)[:, None]
        b_xhat = (b_x * b_rstd[:, None]).to(dx_ptr.dtype.element_ty).to(tl.float32)
        b_dw += tl.sum(b_dy * b_xhat, 0)
        b_dyw = b_dy * b_w[None, :]
        b_dot = tl.sum(b_dyw * b_x, 1) / H
        b_dx = b_rstd[:, None] * (b_dyw - b_x * (b_rstd * b_rstd * b_dot)[:, None])
        tl.store(dx_ptr + o_x, b_dx.to(dx_ptr.dtype.element_ty), mask=m_x)
    tl.store(dw_ptr + i_p.to(tl.int64) * H + o_h, b_dw, mask=m_h)


# ---------------------------------------------------------------- RMSNorm host functions


def _norm_tile(h: int) -> Tuple[int, int, int]:
    """(BLOCK_N rows, BLOCK_H, num_warps) for rows of width h: about 2048 elements a program on a GPU,
    64 rows under the interpreter (it pays per program, not per element)."""
    if h > MAX_NORM_WIDTH:
        raise ValueError(f"H = {h} exceeds the Triton RMSNorm's row limit {MAX_NORM_WIDTH}: use the eager backend")
    block_h = triton.next_power_of_2(h)
    block_n = max(1, 2048 // block_h) if ON_GPU else 64
    return block_n, block_h, 8 if h >= 2048 else 4


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: Optional[torch.dtype] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """x: [N, H] (contiguous), weight: [H] -> (y [N, H] in out_dtype (default x.dtype), rstd [N] fp32)."""
    n, h = x.shape
    y = torch.empty((n, h), dtype=out_dtype or x.dtype, device=x.device)
    rstd = torch.empty(n, dtype=torch.float32, device=x.device)
    if n == 0:
        return y, rstd
    block_n, block_h, warps = _norm_tile(h)
    _rms_norm_fwd_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight.contiguous(),
        y,
        rstd,
        n,
        h,
        float(eps),
        BLOCK_N=block_n,
        BLOCK_H=block_h,
        num_warps=warps,
    )
    return y, rstd


def rms_norm_backward(
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    dy: torch.Tensor,
    row_scale: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gradient of rms_norm_forward at x for the output gradient row_scale[:, None] * dy (or dy).

    x: [N, H] (contiguous); weight: [H]; rstd: [N] fp32 from the forward; dy: [N, H] any float dtype;
    row_scale: [N] fp32 or None -> (dx [N, H] x.dtype, dweight [H] weight.dtype).
    """
    n, h = x.shape
    dx = torch.empty_like(x)
    if n == 0:
        return dx, torch.zeros_like(weight)
    block_n, block_h, warps = _norm_tile(h)
    programs = min(triton.cdiv(n, block_n), 4 * sm_count(x.device) if ON_GPU else 1)
    rows_per_program = triton.cdiv(triton.cdiv(n, programs), block_n) * block_n
    programs = triton.cdiv(n, rows_per_program)
    dw = torch.empty(programs, h, dtype=torch.float32, device=x.device)
    _rms_norm_bwd_kernel[(programs,)](
        x,
        weight.contiguous(),
        rstd,
        dy.contiguous(),
        row_scale if row_scale is not None else rstd,
        dx,
        dw,
        n,
        h,
        rows_per_program,
        HAS_SCALE=row_scale is not None,
        BLOCK_N=block_n,
        BLOCK_H=block_h,
        num_warps=warps,
    )
    return dx, dw.sum(0).to(weight.dtype)


class RmsNormFunction(torch.autograd.Function):
    """The Triton RMSNorm with autograd: x [..., H], weight [H] -> y [..., H] (x.dtype). One read and one write of
    x forward, reads of x and dy and one write of dx backward (the eager twin, target.norm.rms_norm in torch, makes
    fp32 copies of x on both sides)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        y, rstd = rms_norm_forward(rows, weight, eps)
        ctx.save_for_backward(rows, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        rows, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(rows, weight.float(), rstd, dy.reshape(rows.shape))
        return dx.view(dy.shape), dw.to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm_forward with its gradient (RmsNormFunction): x [..., H], weight [H] -> [..., H]."""
    return RmsNormFunction.apply(x, weight, eps)
