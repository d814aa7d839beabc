"""Fused fc-concat projection: ctx = rms_norm(concat_k(hidden[:, k] + noise) @ fc_weight.T) (spec.md §3).

Math, for N tokens, K tapped layers of width H_t, drafter width H:

    y[n, h]  = sum_k sum_t (x[n, k, t] + e[n, k, t]) * W[h, k*H_t + t]      (fp32 accumulation, stored in x.dtype)
    ctx[n]   = w * round(y[n] * rstd[n]),  rstd[n] = 1 / sqrt(mean_h y[n, h]^2 + eps)   (fp32 statistics)

e is optional uniform noise in [-noise_std, noise_std) drawn in-kernel from Philox(seed). The backward
computes only the weight gradients (hidden states are data):

    dw       = sum_n d_ctx[n] * round(y[n] * rstd[n])
    dy[n]    = rstd[n] * (g[n] - yhat[n] * mean_h(g[n] * yhat[n])),  g = d_ctx * w,  yhat = y * rstd
    dW[:, k] = dy.T @ (x[:, k] + e[:, k])                             (one launch per layer k)

Memory touched. Forward: each layer slice x[:, k] is read through its own pointer and row stride (a
tuple of K pointers, so the K*H_t-wide concatenation never exists, whether the caller holds one
[N, K, H_t] tensor or K separate [N, H_t] tensors), W once per row tile, y [N, H] written once; the
norm pass reads y and writes ctx [N, H] and rstd [N]. Backward: the norm pass reads d_ctx and y and
writes dy [N, H] plus per-program dw partials; the weight-gradient GEMM reads dy and x and writes dW.
The noise is regenerated from (seed, element index) in the backward, never stored.

Why the norm is a second light pass, not a GEMM epilogue: the statistics need the whole row of y,
and at full scale (H = 4096, 5120) a row does not fit in one GEMM program's accumulator next to a
useful BLOCK_N (128 x 4096 fp32 is 2 MB of registers). Fusing it would need cross-program
reductions (atomics on sum-of-squares plus a second normalising pass anyway) or tiny row tiles that
waste the tensor cores. The separate pass costs one read of y and one write of ctx (2 x 64 MB at
N = 8192, H = 4096, bf16: ~30 us on an H200), against ~2 ms for the GEMM, and gives the backward the
y it needs.

Why the weight gradient is a Triton GEMM and not cuBLAS: with noise the backward must see the same
noisy x as the forward, and only an in-kernel Philox draw gets it without storing a noisy copy; the
same kernel reads the K layers through their own strides without a concat. Without noise, one
cuBLAS `dy.T @ x[:, k]` per layer would also avoid the concat.

Runs on CUDA and, with TRITON_INTERPRET=1, on CPU tensors (fp32/fp16; the interpreter's bf16 is
wrong). Several configurations are autotuned only on a GPU.
"""
from typing import List, Optional, Sequence, Tuple, Union

import torch
import triton
import triton.language as tl
from dflash_fast.kernels._common import (
    autotune_configs,
    check_device,
    dot_precision,
    rms_norm_backward,
    rms_norm_forward,
)

# (rows, columns, reduction) tile, num_warps, num_stages; rows x columns is the output tile.
_GPU_TILES = [
    (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 128, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (128, 64, 64, 4, 4),
]
# The interpreter pays per program and per loop step, not per element: one config, big tiles.
_INTERPRETER_TILE = (32, 32, 32, 4, 1)


def _configs(rows: str, cols: str, red: str) -> List[triton.Config]:
    return autotune_configs((rows, cols, red), _GPU_TILES, _INTERPRETER_TILE, GROUP=8)


@triton.jit
def _grouped_tile(i_pid, n_a, n_b, GROUP: tl.constexpr):
    """Program id -> (tile index along a, along b), walking GROUP a-tiles down each b column so that
    programs running together share operand tiles in L2."""
    per_group = GROUP * n_b
    first_a = (i_pid // per_group) * GROUP
    size = tl.minimum(n_a - first_a, GROUP)
    i_a = first_a + (i_pid % per_group) % size
    i_b = (i_pid % per_group) // size
    return i_a, i_b


@triton.jit
def _add_uniform_noise(b_x, seed, noise_std, o_n, layer, K, H_T, t0,
                       BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
    """b_x: [BLOCK_N, BLOCK_T] tile of layer `layer` at rows o_n [BLOCK_N], columns t0 + arange(BLOCK_T)
    (t0 % 4 == 0) -> round(b_x + U[-noise_std, noise_std)) in b_x.dtype.

    Element (n, layer, t) takes output t % 4 of Philox counter (n * K + layer) * ceil(H_T / 4) + t // 4:
    a function of the element alone, so the forward and the weight-gradient kernels, whatever their
    tiles, add the same number to the same element, and one Philox call serves four elements.
    """
    ctr = (o_n.to(tl.int64)[:, None] * K + layer) * tl.cdiv(H_T, 4) + (t0 // 4 + tl.arange(0, BLOCK_T // 4))[None, :]
    r0, r1, r2, r3 = tl.randint4x(seed, ctr)
    # [BLOCK_N, BLOCK_T // 4, 2, 2] flattens lane 2p + q of each group of four to r_{2p+q}.
    r = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [BLOCK_N, BLOCK_T])
    u = tl.uint_to_uniform_float(r)
    return (b_x.to(tl.float32) + (2.0 * u - 1.0) * noise_std).to(b_x.dtype)


@triton.jit
def _load_operands(p_a, p_b, m_a, m_b, m_k, EVEN_K: tl.constexpr):
    """The A [M, K] and B [K, N] tiles of one step of a K loop, zero outside: rows of A masked by m_a, columns
    of B by m_b, and the K axis by m_k unless EVEN_K (the K extent is a multiple of the tile: no K mask)."""
    if EVEN_K:
        b_a = tl.load(p_a, mask=m_a[:, None], other=0.0)
        b_b = tl.load(p_b, mask=m_b[None, :], other=0.0)
    else:
        b_a = tl.load(p_a, mask=m_a[:, None] & m_k[None, :], other=0.0)
        b_b = tl.load(p_b, mask=m_k[:, None] & m_b[None, :], other=0.0)
    return b_a, b_b


@triton.autotune(configs=_configs("BLOCK_N", "BLOCK_H", "BLOCK_T"), key=["N", "H", "H_T", "K", "NOISE"])
@triton.heuristics({"EVEN_T": lambda a: a["H_T"] % a["BLOCK_T"] == 0})
@triton.jit(do_not_specialize=["seed"])
def _fc_concat_fwd_kernel(
    x_ptrs, stride_x,  # K-tuples: layer pointers [N, H_t] (unit column stride), their row strides
    w_ptr, stride_w,  # fc weight [H, K*H_t] (unit column stride), its row stride
    y_ptr,  # [N, H] contiguous, pre-norm output in the input dtype
    N, H, H_T, noise_std, seed,
    K: tl.constexpr, NOISE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, GROUP: tl.constexpr,
    EVEN_T: tl.constexpr,
):
    i_n, i_h = _grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(H, BLOCK_H), GROUP)
    o_n = (i_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    o_t = tl.arange(0, BLOCK_T)
    m_n = o_n < N
    m_h = o_h < H
    b_acc = tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32)
    for layer in tl.static_range(K):
        p_x = x_ptrs[layer] + o_n[:, None] * stride_x[layer] + o_t[None, :]
        p_w = w_ptr + o_h.to(tl.int64)[None, :] * stride_w + (layer * H_T + o_t)[:, None]
        for t0 in range(0, H_T, BLOCK_T):
            b_x, b_w = _load_operands(p_x, p_w, m_n, m_h, t0 + o_t < H_T, EVEN_T)
            if NOISE:
                # Masked lanes pick up noise too, but they meet zero weight rows or unstored rows.
                b_x = _add_uniform_noise(b_x, seed, noise_std, o_n, layer, K, H_T, t0, BLOCK_N, BLOCK_T)
            b_acc = tl.dot(b_x, b_w, b_acc, input_precision=PRECISION)
            p_x += BLOCK_T
            p_w += BLOCK_T
    p_y = y_ptr + o_n[:, None] * H + o_h[None, :]
    tl.store(p_y, b_acc.to(y_ptr.dtype.element_ty), mask=m_n[:, None] & m_h[None, :])


@triton.autotune(configs=_configs("BLOCK_H", "BLOCK_T", "BLOCK_N"), key=["N", "H", "H_T", "NOISE"])
@triton.heuristics({"EVEN_N": lambda a: a["N"] % a["BLOCK_N"] == 0})
@triton.jit(do_not_specialize=["layer", "seed"])
def _fc_weight_grad_kernel(
    dy_ptr,  # [N, H] contiguous
    x_ptr, stride_x,  # layer `layer`: [N, H_t] (unit column stride), its row stride
    dw_ptr, stride_dw,  # fc weight gradient [H, K*H_t] (unit column stride), its row stride
    N, H, H_T, layer, K, noise_std, seed,
    NOISE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    i_h, i_t = _grouped_tile(tl.program_id(0), tl.cdiv(H, BLOCK_H), tl.cdiv(H_T, BLOCK_T), GROUP)
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    o_n = tl.arange(0, BLOCK_N)
    m_h = o_h < H
    m_t = o_t < H_T
    p_dy = dy_ptr + o_n[None, :] * H + o_h[:, None]  # [BLOCK_H, BLOCK_N] tile of dy.T
    p_x = x_ptr + o_n[:, None] * stride_x + o_t[None, :]  # [BLOCK_N, BLOCK_T]
    b_acc = tl.zeros([BLOCK_H, BLOCK_T], dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        b_dy, b_x = _load_operands(p_dy, p_x, m_h, m_t, n0 + o_n < N, EVEN_N)
        if NOISE:
            # Masked lanes pick up noise too, but they meet zero dy columns or unstored columns.
            b_x = _add_uniform_noise(b_x, seed, noise_std, n0 + o_n, layer, K, H_T, i_t * BLOCK_T, BLOCK_N, BLOCK_T)
        b_acc = tl.dot(b_dy, b_x, b_acc, input_precision=PRECISION)
        p_dy += BLOCK_N * H
        p_x += BLOCK_N * stride_x
    p_dw = dw_ptr + o_h.to(tl.int64)[:, None] * stride_dw + (layer * H_T + o_t)[None, :]
    tl.store(p_dw, b_acc.to(dw_ptr.dtype.element_ty), mask=m_h[:, None] & m_t[None, :])


def split_layers(hidden: Union[torch.Tensor, Sequence[torch.Tensor]]) -> List[torch.Tensor]:
    """[N, K, H_t] tensor (any strides) or K tensors [N, H_t] -> K detached [N, H_t] views with unit
    column stride. The views share the caller's memory; only a layer whose last dimension is
    strided is copied (that one layer, never the concatenation)."""
    if isinstance(hidden, torch.Tensor):
        if hidden.dim() != 3:
            raise ValueError(
                f"hidden must be [N, K, H_t] or a sequence of K tensors [N, H_t], got shape {tuple(hidden.shape)}"
            )
        layers = list(hidden.detach().unbind(1))
    else:
        layers = [x.detach() for x in hidden]
        if not layers:
            raise ValueError("hidden is an empty sequence: pass K >= 1 tensors [N, H_t]")
        first = layers[0]
        for k, x in enumerate(layers):
            if x.dim() != 2 or x.shape != first.shape or x.dtype != first.dtype or x.device != first.device:
                raise ValueError(
                    f"hidden[{k}] is {tuple(x.shape)} {x.dtype} on {x.device} but hidden[0] is "
                    f"{tuple(first.shape)} {first.dtype} on {first.device}: every layer must be the same "
                    f"[N, H_t] dtype and device"
                )
    return [x if x.stride(1) == 1 else x.contiguous() for x in layers]


def _check(layers: Sequence[torch.Tensor], fc_weight: torch.Tensor, norm_weight: torch.Tensor) -> None:
    x = layers[0]
    n, h_t = x.shape
    k = len(layers)
    if fc_weight.dim() != 2 or fc_weight.shape[1] != k * h_t:
        raise ValueError(f"fc_weight is {tuple(fc_weight.shape)} but K*H_t = {k}*{h_t} = {k * h_t}")
    h = fc_weight.shape[0]
    if tuple(norm_weight.shape) != (h,):
        raise ValueError(
            f"norm_weight is {tuple(norm_weight.shape)} but fc_weight gives H = {h}: pass the hidden_norm weight [{h}]"
        )
    if fc_weight.dtype != x.dtype:
        raise ValueError(
            f"hidden is {x.dtype} but fc_weight is {fc_weight.dtype}: cast one so both match, as nn.Linear requires"
        )
    if fc_weight.device != x.device or norm_weight.device != x.device:
        raise ValueError(
            f"hidden is on {x.device}, fc_weight on {fc_weight.device}, norm_weight on "
            f"{norm_weight.device}: move them to one device"
        )
    check_device("fc_concat", x)


def fc_concat_forward(
    layers: Sequence[torch.Tensor],
    fc_weight: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    noise_std: float = 0.0,
    seed: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """layers: K [N, H_t] with unit column stride (`split_layers`); fc_weight: [H, K*H_t];
    norm_weight: [H] -> (ctx [N, H] in promote(norm_weight, hidden) dtype, y [N, H] pre-norm in the
    hidden dtype, rstd [N] fp32)."""
    _check(layers, fc_weight, norm_weight)
    x = layers[0]
    n, h_t = x.shape
    h = fc_weight.shape[0]
    weight = fc_weight if fc_weight.stride(1) == 1 else fc_weight.contiguous()
    y = torch.empty((n, h), dtype=x.dtype, device=x.device)
    if n == 0:
        return (
            torch.empty((n, h), dtype=torch.promote_types(norm_weight.dtype, x.dtype), device=x.device),
            y,
            torch.empty(n, dtype=torch.float32, device=x.device),
        )
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]) * triton.cdiv(h, meta["BLOCK_H"]),)
    _fc_concat_fwd_kernel[grid](
        tuple(layers), tuple(layer.stride(0) for layer in layers),
        weight, weight.stride(0),
        y,
        n, h, h_t, float(noise_std), int(seed),
        K=len(layers), NOISE=noise_std > 0, PRECISION=dot_precision(x.dtype),
    )
    ctx, rstd = rms_norm_forward(y, norm_weight, eps, out_dtype=torch.promote_types(norm_weight.dtype, x.dtype))
    return ctx, y, rstd


def fc_concat_backward(
    d_ctx: torch.Tensor,
    layers: Sequence[torch.Tensor],
    fc_weight: torch.Tensor,
    norm_weight: torch.Tensor,
    y: torch.Tensor,
    rstd: torch.Tensor,
    noise_std: float = 0.0,
    seed: int = 0,
    fc_weight_grad: bool = True,
) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
    """d_ctx: [N, H]; layers, fc_weight, norm_weight, noise_std, seed as in the forward; y [N, H],
    rstd [N] from the forward -> (d_fc_weight [H, K*H_t] or None when not fc_weight_grad,
    d_norm_weight [H])."""
    n, h = y.shape
    h_t = layers[0].shape[1]
    if n == 0:
        d_fc = torch.zeros_like(fc_weight) if fc_weight_grad else None
        return d_fc, torch.zeros_like(norm_weight)
    dy, d_norm = rms_norm_backward(y, norm_weight, rstd, d_ctx)
    if not fc_weight_grad:
        return None, d_norm
    d_fc = torch.empty(fc_weight.shape, dtype=fc_weight.dtype, device=fc_weight.device)
    grid = lambda meta: (triton.cdiv(h, meta["BLOCK_H"]) * triton.cdiv(h_t, meta["BLOCK_T"]),)
    for k, x in enumerate(layers):
        _fc_weight_grad_kernel[grid](
            dy,
            x, x.stride(0),
            d_fc, d_fc.stride(0),
            n, h, h_t, k, len(layers), float(noise_std), int(seed),
            NOISE=noise_std > 0, PRECISION=dot_precision(x.dtype),
        )
    return d_fc, d_norm


class FcConcatFunction(torch.autograd.Function):
    """Gradients for fc_weight and norm_weight only; the hidden layers are saved, not differentiated."""

    @staticmethod
    def forward(ctx, fc_weight, norm_weight, eps, noise_std, seed, *layers):
        out, y, rstd = fc_concat_forward(layers, fc_weight, norm_weight, eps, noise_std, seed)
        ctx.save_for_backward(fc_weight, norm_weight, y, rstd, *layers)
        ctx.noise_std, ctx.seed = noise_std, seed
        return out

    @staticmethod
    def backward(ctx, d_ctx):
        fc_weight, norm_weight, y, rstd, *layers = ctx.saved_tensors
        d_fc, d_norm = fc_concat_backward(
            d_ctx, layers, fc_weight, norm_weight, y, rstd, ctx.noise_std, ctx.seed,
            fc_weight_grad=ctx.needs_input_grad[0],
        )
        return (d_fc, d_norm if ctx.needs_input_grad[1] else None, None, None, None) + (None,) * len(layers)


def fc_concat(
    hidden: Union[torch.Tensor, Sequence[torch.Tensor]],
    fc_weight: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    noise_std: float = 0.0,
    seed: int = 0,
) -> torch.Tensor:
    """ctx = rms_norm(concat_k(hidden[:, k] + noise) @ fc_weight.T, norm_weight), without the concat.

    hidden: [N, K, H_t] (any strides) or K tensors [N, H_t]; fc_weight: [H, K*H_t]; norm_weight: [H]
    -> ctx [N, H]. `noise_std > 0` adds uniform noise in [-noise_std, noise_std) drawn from `seed`
    (same distribution as the eager twin, different numbers). No gradient flows into hidden.
    Semantics: `dflash_fast.drafter.eager.fc_concat`.
    """
    if noise_std < 0:
        raise ValueError(f"noise_std = {noise_std} must be >= 0 (0 disables the noise)")
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed = {seed} must be in [0, 2**63)")
    return FcConcatFunction.apply(fc_weight, norm_weight, eps, noise_std, seed, *split_layers(hidden))
