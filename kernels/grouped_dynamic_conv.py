"""DFlash2's grouped dynamic causal convolution inside each draft block, one Triton kernel per direction (spec.md §9).

Math, for N rows x [N, H] (row n is slot s(n) = n % B of its block of B slots), taps T <= B, H / GS groups of GS
channels (g(c) = c // GS), delta [N, T, G], base [T, H]:

    c_n[t, c] = round(base[t, c]) + delta_n[t, g(c)]             (base rounded to x.dtype, as the eager twin)
    y_n[c]    = r_n[c] + sum_{t < T, t <= s(n)} x_{n-t}[c] * c_n[t, c]   (fp32 accumulation, stored in x.dtype)

with r [N, H] an optional residual (the decoder layer's residual add fused into conv_out: the sum is written once,
the conv's own output never is; without it r = 0). Taps never reach across a block start (t <= s(n)); a last block
shorter than B is allowed. Backward, for dy [N, H] (d r = dy, handed on as is: no copy, no pass):

    dx_m[c]         = sum_{t: s(m) + t < B, m + t < N} dy_{m+t}[c] * c_{m+t}[t, c]
    d delta_n[t, g] = sum_{c in g} dy_n[c] * x_{n-t}[c]          (t <= s(n), else 0)
    d base[t, c]    = sum_n dy_n[c] * x_{n-t}[c]                  (per-program partials over row tiles, summed on
                                                                    the host: no atomics, deterministic)

Each program owns BLOCK_N rows and BLOCK_G whole groups (a [BLOCK_N, BLOCK_G, GS_P2] tile, GS_P2 = GS rounded up
to a power of two and masked), so the group reduction of d delta stays inside one program.

Memory touched. Forward: x read once (the earlier slots a tap needs are the rows just above the tile: cache hits,
plus T - 1 rows per tile), delta [N, T, G] and base [T, H] read once, the residual (if any) read once, y [N, H]
written once. Backward: x, dy, delta,
base read once each (the later rows dx needs are again the tile's neighbours), dx [N, H] and d delta [N, T, G]
written once, d base as fp32 partials [N / BLOCK_N, T, H] and their sum. The eager twin
(`dflash_fast.drafter.conv.grouped_dynamic_conv`) moves ~9x (forward) to ~12x (with backward) more.

Around the kernels, as a DFlash2 sublayer runs them: `grouped_dynamic_conv(..., residual=)` is conv_out with the
layer's residual add (DynamicConv.finish); `projected_conv` is the kernel projection (a torch GEMM) and conv_in in one
autograd Function (DynamicConv.prepare) whose backward writes conv_in's d delta into the projection's gradient and
adds the projection's dgrad into conv_in's dx by one in-place addmm (no separate [N, H] dgrad and sum).

Runs on CUDA and, with TRITON_INTERPRET=1, on CPU tensors (fp32/fp16; the interpreter's bf16 is wrong). No
autotuning: the backward's partial buffer is sized by the row tile, which the host picks (`_tiles`).
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from dflash_fast.kernels._common import ON_GPU, check_device


@triton.jit
def _tile(N, H, G, B, GS: tl.constexpr, GS_P2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
    """This program's tile, BLOCK_N rows x BLOCK_G groups of GS channels (GS_P2 lanes, the rest masked):
    o_n [BLOCK_N] rows, o_g [BLOCK_G] groups, o_c [BLOCK_G, GS_P2] channels, o_nc [BLOCK_N, BLOCK_G, GS_P2] the
    elements' offsets in an [N, H] tensor; m_n, m_g, m_c, m_nc their masks; s_n [BLOCK_N] each row's slot in its
    block of B."""
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    o_g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    o_j = tl.arange(0, GS_P2)
    o_c = o_g[:, None] * GS + o_j[None, :]
    m_n, m_g = o_n < N, o_g < G
    m_c = m_g[:, None] & (o_j < GS)[None, :]
    o_nc = o_n.to(tl.int64)[:, None, None] * H + o_c[None, :, :]
    m_nc = m_n[:, None, None] & m_c[None, :, :]
    return o_n, o_g, o_c, o_nc, m_n, m_g, m_c, m_nc, o_n % B


@triton.jit
def _conv_fwd_kernel(
    x_ptr,  # [N, H] contiguous
    d_ptr, stride_dn, stride_dt,  # delta [N, T, G] (unit group stride), its row and tap strides
    base_ptr,  # [T, H] contiguous
    r_ptr,  # residual [N, H] contiguous, x.dtype (read only when HAS_RESIDUAL)
    y_ptr,  # [N, H] contiguous, x.dtype
    N, H, G, B,
    T: tl.constexpr, GS: tl.constexpr, GS_P2: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    o_n, o_g, o_c, o_nc, m_n, m_g, m_c, m_nc, s_n = _tile(N, H, G, B, GS, GS_P2, BLOCK_N, BLOCK_G)
    b_acc = tl.zeros([BLOCK_N, BLOCK_G, GS_P2], dtype=tl.float32)
    for t in tl.static_range(T):
        m_r = m_n & (s_n >= t)  # the tap stays inside the block
        o_x = (o_n - t).to(tl.int64)[:, None, None] * H + o_c[None, :, :]
        b_x = tl.load(x_ptr + o_x, mask=m_r[:, None, None] & m_c[None, :, :], other=0.0).to(tl.float32)
        p_d = d_ptr + o_n.to(tl.int64)[:, None] * stride_dn + t * stride_dt + o_g[None, :]
        b_d = tl.load(p_d, mask=m_r[:, None] & m_g[None, :], other=0.0).to(tl.float32)
        b_base = tl.load(base_ptr + t * H + o_c, mask=m_c, other=0.0).to(x_ptr.dtype.element_ty).to(tl.float32)
        b_acc += b_x * (b_base[None, :, :] + b_d[:, :, None])
    if HAS_RESIDUAL:
        b_acc += tl.load(r_ptr + o_nc, mask=m_nc, other=0.0).to(tl.float32)
    tl.store(y_ptr + o_nc, b_acc.to(y_ptr.dtype.element_ty), mask=m_nc)


@triton.jit
def _conv_bwd_kernel(
    x_ptr, dy_ptr,  # [N, H] contiguous
    d_ptr, stride_dn, stride_dt,  # delta [N, T, G] (unit group stride), its row and tap strides
    base_ptr,  # [T, H] contiguous
    dx_ptr,  # [N, H] contiguous, x.dtype
    dd_ptr, stride_ddn, stride_ddt,  # d delta [N, T, G] (unit group stride), delta.dtype, its row and tap strides
    dbase_ptr,  # [programs along N, T, H] fp32 partials
    N, H, G, B,
    T: tl.constexpr, GS: tl.constexpr, GS_P2: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
):
    o_n, o_g, o_c, o_nc, m_n, m_g, m_c, m_nc, s_n = _tile(N, H, G, B, GS, GS_P2, BLOCK_N, BLOCK_G)
    b_dy = tl.load(dy_ptr + o_nc, mask=m_nc, other=0.0).to(tl.float32)
    b_dx = tl.zeros([BLOCK_N, BLOCK_G, GS_P2], dtype=tl.float32)
    for t in tl.static_range(T):
        b_base = tl.load(base_ptr + t * H + o_c, mask=m_c, other=0.0).to(x_ptr.dtype.element_ty).to(tl.float32)
        # d delta and d base of tap t: dy_n against x_{n-t}, inside the block
        m_back = m_n & (s_n >= t)
        o_x = (o_n - t).to(tl.int64)[:, None, None] * H + o_c[None, :, :]
        b_x = tl.load(x_ptr + o_x, mask=m_back[:, None, None] & m_c[None, :, :], other=0.0).to(tl.float32)
        b_prod = b_dy * b_x
        p_dd = dd_ptr + o_n.to(tl.int64)[:, None] * stride_ddn + t * stride_ddt + o_g[None, :]
        tl.store(p_dd, tl.sum(b_prod, 2).to(dd_ptr.dtype.element_ty), mask=m_n[:, None] & m_g[None, :])
        p_db = dbase_ptr + (tl.program_id(0).to(tl.int64) * T + t) * H + o_c
        tl.store(p_db, tl.sum(b_prod, 0), mask=m_c)
        # dx_m += dy_{m+t} * c_{m+t}[t], while m + t stays in m's block
        m_fwd = m_n & (s_n + t < B) & (o_n + t < N)
        o_f = (o_n + t).to(tl.int64)
        b_dyf = tl.load(dy_ptr + o_f[:, None, None] * H + o_c[None, :, :], mask=m_fwd[:, None, None] & m_c[None, :, :],
                        other=0.0).to(tl.float32)
        p_d = d_ptr + o_f[:, None] * stride_dn + t * stride_dt + o_g[None, :]
        b_d = tl.load(p_d, mask=m_fwd[:, None] & m_g[None, :], other=0.0).to(tl.float32)
        b_dx += b_dyf * (b_base[None, :, :] + b_d[:, :, None])
    tl.store(dx_ptr + o_nc, b_dx.to(dx_ptr.dtype.element_ty), mask=m_nc)


def _tiles(group_size: int) -> Tuple[int, int, int, int]:
    """(BLOCK_N rows, BLOCK_G groups, GS_P2, num_warps): ~4096 elements a program on a GPU (a [32, 128] tile of
    fp32 accumulators plus the loads: no spills); 64 rows x ~256 channels under the interpreter (it pays per
    program, not per element)."""
    gs_p2 = triton.next_power_of_2(group_size)
    if ON_GPU:
        return 32, max(1, 128 // gs_p2), gs_p2, 4
    return 64, max(1, 256 // gs_p2), gs_p2, 4


def _check(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int, group_size: int,
           residual: Optional[torch.Tensor] = None) -> None:
    n, h = x.shape
    taps = base.shape[0]
    if group_size < 1 or h % group_size:
        raise ValueError(f"group_size = {group_size} must divide H = {h}")
    if tuple(delta.shape) != (n, taps, h // group_size) or tuple(base.shape) != (taps, h):
        raise ValueError(
            f"x [N, H] = {tuple(x.shape)} needs delta [N, taps, H / group_size] and base [taps, H]; got delta "
            f"{tuple(delta.shape)} and base {tuple(base.shape)}"
        )
    if not 1 <= taps <= block_size:
        raise ValueError(f"taps = {taps} must be in [1, block_size = {block_size}]: taps never cross a block start")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"the residual [N, H] must be x's shape and dtype {tuple(x.shape)} {x.dtype}; got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    check_device("grouped_dynamic_conv", x, delta, base, *([] if residual is None else [residual]))


def conv_forward(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int, group_size: int,
                 residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [N, H] (contiguous), delta [N, taps, G] (unit last stride), base [taps, H], residual [N, H] (contiguous) or
    None -> y [N, H] in x.dtype: residual + conv(x), written once."""
    _check(x, delta, base, block_size, group_size, residual)
    n, h = x.shape
    y = torch.empty_like(x)
    if n == 0:
        return y
    block_n, block_g, gs_p2, warps = _tiles(group_size)
    groups = h // group_size
    grid = (triton.cdiv(n, block_n), triton.cdiv(groups, block_g))
    _conv_fwd_kernel[grid](
        x, delta, delta.stride(0), delta.stride(1), base.contiguous(), x if residual is None else residual, y,
        n, h, groups, block_size,
        T=base.shape[0], GS=group_size, GS_P2=gs_p2, BLOCK_N=block_n, BLOCK_G=block_g,
        HAS_RESIDUAL=residual is not None, num_warps=warps,
    )
    return y


def conv_backward(dy: torch.Tensor, x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int,
                  group_size: int, d_delta: Optional[torch.Tensor] = None
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dy, x [N, H] (contiguous), delta [N, taps, G], base [taps, H] -> (dx [N, H] x.dtype, d delta [N, taps, G]
    delta.dtype, d base [taps, H] base.dtype). d_delta: where to write d delta ([N, taps, G], unit last stride: a
    slice of the projection's gradient), else a new tensor."""
    n, h = x.shape
    taps, groups = base.shape[0], h // group_size
    dx = torch.empty_like(x)
    if d_delta is None:
        d_delta = torch.empty((n, taps, groups), dtype=delta.dtype, device=x.device)
    if n == 0:
        return dx, d_delta, torch.zeros_like(base)
    block_n, block_g, gs_p2, warps = _tiles(group_size)
    grid = (triton.cdiv(n, block_n), triton.cdiv(groups, block_g))
    d_base = torch.empty((grid[0], taps, h), dtype=torch.float32, device=x.device)
    _conv_bwd_kernel[grid](
        x, dy.contiguous(), delta, delta.stride(0), delta.stride(1), base.contiguous(), dx,
        d_delta, d_delta.stride(0), d_delta.stride(1), d_base,
        n, h, groups, block_size,
        T=taps, GS=group_size, GS_P2=gs_p2, BLOCK_N=block_n, BLOCK_G=block_g, num_warps=warps,
    )
    return dx, d_delta, d_base.sum(0).to(base.dtype)


class GroupedDynamicConvFunction(torch.autograd.Function):
    """Gradients for x, delta, base and the residual (dy itself); x and the coefficients are saved, y is not."""

    @staticmethod
    def forward(ctx, x, delta, base, block_size, group_size, residual):
        y = conv_forward(x, delta, base, block_size, group_size, residual)
        ctx.save_for_backward(x, delta, base)
        ctx.block_size, ctx.group_size = block_size, group_size
        return y

    @staticmethod
    def backward(ctx, dy):
        x, delta, base = ctx.saved_tensors
        dx, d_delta, d_base = conv_backward(dy, x, delta, base, ctx.block_size, ctx.group_size)
        need = ctx.needs_input_grad
        return (dx if need[0] else None, d_delta if need[1] else None, d_base if need[2] else None, None, None,
                dy if need[5] else None)


class ProjectedConvFunction(torch.autograd.Function):
    """The kernel projection of a sublayer's normed input and conv_in in one Function (`DynamicConv.prepare`):
    delta = x W^T [N, 2, taps, G] drives conv_in (delta[:, 0], here) and conv_out (delta[:, 1], returned as a view).
    Backward: the kernel writes conv_in's d delta into its half of one [N, 2, taps, G] gradient (conv_out's half
    copied in: 1/8 of an [N, H] pass at taps 2, groups of 16), and the projection's dgrad accumulates into conv_in's
    dx by one in-place addmm (beta = 1: the GEMM reads dx and writes dx), where autograd would write the dgrad and
    then add the two [N, H] gradients (2 passes more). x, W, base and delta are saved; y is not."""

    @staticmethod
    def forward(ctx, x, weight, base, block_size, group_size):
        taps, groups = base.shape[0], x.shape[1] // group_size
        delta = (x @ weight.t()).view(x.shape[0], 2, taps, groups)
        y = conv_forward(x, delta[:, 0], base, block_size, group_size)
        ctx.save_for_backward(x, weight, base, delta)
        ctx.block_size, ctx.group_size = block_size, group_size
        return y, delta[:, 1]

    @staticmethod
    def backward(ctx, dy, d_delta_out):
        x, weight, base, delta = ctx.saved_tensors
        d_delta = torch.empty_like(delta)
        dx, _, d_base = conv_backward(dy, x, delta[:, 0], base, ctx.block_size, ctx.group_size, d_delta[:, 0])
        if d_delta_out is None:
            d_delta[:, 1].zero_()
        else:
            d_delta[:, 1].copy_(d_delta_out)
        d_delta = d_delta.view(x.shape[0], -1)
        d_weight = d_delta.t() @ x if ctx.needs_input_grad[1] else None
        dx.addmm_(d_delta, weight)  # the projection's dgrad, accumulated into conv_in's dx
        return dx, d_weight, d_base if ctx.needs_input_grad[2] else None, None, None


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., H] -> [N, H] with unit channel stride and row stride H (a view where it already is one)."""
    h = t.shape[-1]
    t2 = t.reshape(-1, h)
    if t2.stride(1) != 1 or (t2.shape[0] > 1 and t2.stride(0) != h):
        t2 = t2.contiguous()
    return t2


def grouped_dynamic_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int, group_size: int,
                         residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y_s = residual_s + sum_{t <= s} x_{s-t} * (base[t] + delta_s[t, group]) inside each block of `block_size`
    slots (residual_s = 0 without one).

    x [..., H] (rows in order, block starts at row multiples of block_size; a last short block is allowed), delta
    [..., taps, H / group_size] (any strides with a unit last one: a slice of the kernel projection's output is
    read in place), base [taps, H], residual [..., H] (x's shape and dtype) or None -> y [..., H] in x.dtype.
    Semantics: `dflash_fast.drafter.conv.grouped_dynamic_conv` (its x is [R, A*B, H]; rows here run on across
    R, which is the same as R*A*B rows).
    """
    d2 = delta.reshape(-1, *delta.shape[-2:])
    if d2.stride(2) != 1:
        d2 = d2.contiguous()
    r2 = None if residual is None else _rows(residual)
    return GroupedDynamicConvFunction.apply(_rows(x), d2, base, block_size, group_size, r2).view(x.shape)


def projected_conv(x: torch.Tensor, weight: torch.Tensor, base: torch.Tensor, block_size: int,
                   group_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] (a sublayer's normed input), weight [2 taps G, H] (the kernel projection), base [taps, H] (conv_in's)
    -> (conv_in(x) [..., H], conv_out's delta [..., taps, G]) with delta = x W^T viewed [..., 2, taps, G]; the
    backward as `ProjectedConvFunction`. Semantics: `dflash_fast.drafter.conv.projected_conv`."""
    taps, groups = base.shape[0], x.shape[-1] // group_size
    y, delta_out = ProjectedConvFunction.apply(_rows(x), weight, base, block_size, group_size)
    return y.view(x.shape), delta_out.view(*x.shape[:-1], taps, groups)
