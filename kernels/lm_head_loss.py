"""Fused drafter norm + lm_head + loss against the teacher (spec.md §5) that never builds [N, V] logits.

Same signature, result and semantics as `dflash_fast.drafter.eager.lm_head_loss`; the gradients (dh,
d norm_weight, and d lm_head_weight when it requires grad) are computed during the forward,
because the loss is the final scalar: backward only scales them by the incoming gradient.

Math (per drafter row n; s = drafter logits, t = teacher logits, fp32-accumulated):
    xd = rms_norm(h, norm_weight) [N, H], xt = rms_norm(last, final_norm_weight) [U, H]
    s_v = xd_n . W_v,  t_v = xt_{index[n]} . W_v,  lse(s) = log sum_v exp(s_v)
    kl      l = lse(s) - sum_v p_v s_v, p = softmax(t); KL = sum p (t - s) - lse(t) + lse(s)
    ce      l = lse(s) - s_y, y = stored label or argmax(t)
    ce_data l = lse(s) - s_y, y = dataset label
    kl_topk l = -(sum_i p_i (s_{id_i} - lse(s)) + p_rest (lse_{v not in ids}(s) - lse(s)))
    dl/ds_v = c q_v - target_v, q = softmax(s), c = sum of the target mass (1 except kl_topk)
    tv, lk, lk_hybrid, rkl, jsd: functions of q, p and alpha = sum_v min(p_v, q_v) (eager.dense_row_losses);
    their gradients in `_dense_grad`. alpha [N] comes out for every kind (losses.LossOutput).
    DSpark (markov, spec.md §8): s_v = xd_n . W_v + e_n . W2_v, i.e. [xd_n, e_n] against [W, W2]: the Markov bias
    is r more columns of the same GEMM (no [N, V] bias); de_n = w_n/denom dl/ds_n @ W2, dW2 = sum_n w_n/denom
    dl/ds_n e_n^T; alpha_n = sum_v min(q_v, p_v) (the confidence target) comes out of pass 4 as for every kind.
    row weight w_n = weights_n, or weights_n * D-PACE_n (losses.dpace_weights, from the confidence
    exp(s_y - lse(s)) of the label y the loss reports as teacher_argmax); loss = sum_n w_n l_n / denom.

Passes, for each chunk of C drafter rows (C sized so that the chunk's buffers fit CHUNK_BYTES: 1024
rows at V = 151936 in bf16, see `chunk_rows`; a multiple of the D-PACE block, so that every block is
inside one chunk). U_c = the distinct teacher rows the chunk's rows
point at (the dense kinds and ce against argmax(t)): a teacher position shared by overlapping blocks is computed
once per chunk, not once per slot.
  1. `rms_norm_forward` (kernels/_common.py): xd of the chunk and xt of its U_c teacher rows, O((C + U_c) H).
  2. `_logits_fwd_kernel`: the GEMM [xd ; xt] @ W^T -> fp32 logits [C + U_c, V] kept for the chunk (t
     only for the dense kinds: ce needs only argmax(t)), and per (row, vocab tile of LOGITS_BLOCK_V ids) the tile's
     max, sum of exp(x - max) and first argmax. Grouped tile order: the programs of one vocab tile for
     every row tile are consecutive, so one wave reads each W tile from HBM once and the chunk's
     activations stay in L2.
  3. `_softmax_merge_fwd_kernel`: the partials of each row -> lse and first argmax (torch.argmax ties).
  4. `_dlogits_bwd_kernel`, one pass over each row of the stored logits (two with kl_topk, whose
     lse over the ids that are not in the top-k is needed before the gradient, and with tv, lk,
     lk_hybrid, rkl, jsd, whose gradients need alpha, sum_{q<p} q or their divergence first): the row
     sums (sum_v p_v s_v, KL(p||q), alpha, ...), and, when an input needs a gradient, dl/ds formed in
     fp32 and rounded to the input dtype, into a [C, V] chunk (without the row weight, which would push
     fp16 entries into underflow). Skipped for ce and ce_data without gradients.
  5. The D-PACE weights of the chunk's blocks (torch, O(C)), from lse and the stored s at the label.
  6. `_matmul_bwd_kernel`: dxd = dlogits @ W [C, H] fp32 (K = V), then `rms_norm_backward` ->
     dh of the chunk and its share of d norm_weight; with a trainable lm_head also
     dW += dlogits^T @ (w/denom * xd) into an fp32 accumulator [V, H] (tile order: one row tile of
     dW for every column tile before the next, so each dlogits tile is read once); with DSpark's Markov
     bias the dxd GEMM takes W2 [V, r] as a second B operand (HAS_MARKOV): its programs spread W2's r
     columns among them and form de [C, r] and dW2 += [V, r] (fp32, atomic adds) from the dlogits tiles
     they load for dxd anyway, so dlogits is read once for all three GEMMs.

FLOPs, in GEMM units of 2 N V H (~10.2 TFLOP at N = 8192, H = 4096, V = 151936):
  kl, tv, lk, lk_hybrid, rkl, jsd, ce against argmax(t): 1 (s) + U/N (t, U = sum_c U_c: ~0.35 N at the
  reference rows) + 1 (dxd); tv ... jsd add one read of the chunk's stored logits, no GEMM
  ce with stored labels, ce_data, kl_topk: 1 + 1 = 2;  +1 each when lm_head trains (dW)
  without a gradient: 1 + U/N, or 1.
  eager: kl 3 (+1), ce 2 (+1), but it streams [N, V] fp32 tensors a dozen times.
  DSpark's Markov bias of rank r adds 3 r/H (s, de, dW2): 0.19 at r = 256, H = 4096.
Why keep the logits of a chunk rather than recompute them for the gradient, or accumulate
sum_v q_v W_v online (flash-attention style): recomputing costs a GEMM unit per operand (s, and t),
while the chunk's fp32 logits cost 4 bytes per (row, id) written once and read once or twice (~12 GB
at the reference shape, ~3 ms at 4.3 TB/s, against 13 ms per unit); the online accumulators q W
and p W are each ~|W| while their difference, the gradient, goes to 0 as the drafter learns, so
rounding them to bf16 for the GEMM would give large relative gradient errors, and they are [N, H]
wide (read-modify-written by every tile).

Memory beyond inputs and outputs, whatever N is: the chunk's fp32 logits [C + U_max, V] (U_max <=
C), its dlogits [C, V] in the input dtype, the partials 3 x [V / LOGITS_BLOCK_V, C + U_max], xd, xt
and dxd of one chunk, O(N) per-row statistics: ~1.5 GB at V = 151936 in bf16; and, only when
lm_head trains, the fp32 dW accumulator [V, H] (2.5 GB; summing the chunks in bf16 would round dW
once per chunk); with DSpark's Markov bias the fp32 dW2 accumulator [V, r] (156 MB at r = 256) and de.
The only host synchronisation is the chunk plan (the U_c), once per call.
Offsets that scale with rows * V, V * H or rows * H are int64: N * V is already 1.2e9 at N = 8192.
"""
import math
from typing import List, NamedTuple, Optional, Tuple, Union

import torch
import triton
import triton.language as tl
from dflash_fast.kernels._common import (
    ON_GPU,
    autotune_configs,
    check_device,
    dot_precision,
    rms_norm_backward,
    rms_norm_forward,
)

from dflash_fast.drafter.losses import (
    DENSE_KINDS,
    LK_HYBRID_ETA,
    LK_MIN_ALPHA,
    DPace,
    LossOutput,
    Markov,
    Teacher,
    check_loss_inputs,
    dpace_weights,
    has_kl,
    needs_last,
)

# Bytes of one chunk's buffers (fp32 logits of its rows and their teacher rows, dlogits): 1.5 GiB on a GPU;
# 16-row chunks under the interpreter, so that small tests cross chunk boundaries.
GPU_CHUNK_BYTES = 3 << 29
CHUNK_BYTES = GPU_CHUNK_BYTES if ON_GPU else 1 << 16
# Vocabulary ids per logits tile, fixed so that the softmax partials have one layout whatever config runs.
# 128: with 128-row tiles the accumulator is 64 registers a thread; [128, 256] tiles spill under Triton 3.6.
LOGITS_BLOCK_V = 128
# Rows per chunk are a multiple of this (a whole number of the GEMMs' row tiles).
GPU_ROW_ALIGN = 128
ROW_ALIGN = GPU_ROW_ALIGN if ON_GPU else 16

_LOGITS_TILES = autotune_configs(
    ("BLOCK_M", "BLOCK_K"), [(128, 64, 8, 3), (128, 64, 8, 4), (128, 32, 8, 4), (64, 64, 4, 4)], (16, 64, 4, 1)
)
# (128, 256) tiles spill when the dW GEMM accumulates and scales (a trainable lm_head), under 3.6 and 3.9.
_MATMUL_TILES = autotune_configs(
    ("BLOCK_M", "BLOCK_NC", "BLOCK_K"),
    [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (64, 128, 64, 4, 4)],
    (64, 64, 64, 4, 1),
)
# Triton kernels read module globals only as constexprs.
_LOG2 = tl.constexpr(math.log(2.0))
_LK_MIN_ALPHA = tl.constexpr(LK_MIN_ALPHA)
_LK_HYBRID_ETA = tl.constexpr(LK_HYBRID_ETA)
# The rows of `_dlogits_bwd_kernel`'s out [OUT_ROWS, N]: sum p s, KL(p||q), lse_rest, alpha, below, and the
# divergences of rkl (KL(q||p)) and jsd (KL(q||m), KL(p||m)).
OUT_ROWS = 7
_ROW_TILES = autotune_configs(
    ("BLOCK_N", "BLOCK_V"), [(1, 2048, 4, 2), (1, 1024, 4, 2), (4, 1024, 4, 2)], (16, 256, 4, 1)
)


@triton.jit
def _tile_order(pid, n_m, n_n, group_m):
    """Program pid -> (i_m, i_n): group_m row tiles for every column tile, then the next group_m rows.

    group_m >= n_m walks every row tile of a column tile first (the column operand is read once per
    wave); group_m = 1 walks every column tile of a row tile first (the row operand is read once).
    """
    width = group_m * n_n
    first_m = (pid // width) * group_m
    rows = tl.minimum(n_m - first_m, group_m)
    return first_m + (pid % width) % rows, (pid % width) // rows


@triton.autotune(configs=_LOGITS_TILES, key=["H", "HAS_BIAS"])
@triton.jit
def _logits_fwd_kernel(
    x_ptr,
    w_ptr,
    e_ptr,
    w2_ptr,
    logits_ptr,
    max_ptr,
    sum_ptr,
    arg_ptr,
    M,
    V,
    H,
    R,
    n_store,
    n_bias,
    stride_w,
    stride_w2,
    group_m,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """logits[m] = x[m] @ W^T (+ e[m] @ W2^T for the rows m < n_bias, HAS_BIAS: DSpark's Markov bias, the
    same accumulator over R more columns) (fp32) for the rows m < n_store, and for every row its tile's
    softmax partials: max, sum of exp(x - max), first argmax. x: [M, H]; W: [V, H]; e: [n_bias, R];
    W2: [V, R]; logits: [n_store, V]; max, sum, arg: [cdiv(V, BLOCK_V), M] (arg int32, a vocabulary id)."""
    i_m, i_v = _tile_order(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(V, BLOCK_V), group_m)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    m_m, m_v = o_m < M, o_v < V
    o_x = o_m.to(tl.int64)[:, None] * H
    o_w = o_v.to(tl.int64)[None, :] * stride_w
    b_acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < H
        b_x = tl.load(x_ptr + o_x + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_w = tl.load(w_ptr + o_w + o_k[:, None], mask=m_k[:, None] & m_v[None, :], other=0.0)  # [BLOCK_K, BLOCK_V]
        b_acc = tl.dot(b_x, b_w, b_acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        m_e = m_m & (o_m < n_bias)
        o_w2 = o_v.to(tl.int64)[None, :] * stride_w2
        for k0 in range(0, R, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_k = o_k < R
            b_e = tl.load(e_ptr + o_m.to(tl.int64)[:, None] * R + o_k[None, :], mask=m_e[:, None] & m_k[None, :],
                          other=0.0)
            b_w2 = tl.load(w2_ptr + o_w2 + o_k[:, None], mask=m_k[:, None] & m_v[None, :], other=0.0)
            b_acc = tl.dot(b_e, b_w2, b_acc, input_precision=DOT_PRECISION)
    m_out = (m_m & (o_m < n_store))[:, None] & m_v[None, :]
    tl.store(logits_ptr + o_m.to(tl.int64)[:, None] * V + o_v[None, :], b_acc, mask=m_out)
    # Stored first and read last by the sum of exponentials, the accumulator's registers are free for the
    # statistics (a second [BLOCK_M, BLOCK_V] tile, or tl.max's index tile, doubles the registers).
    b_acc = tl.where(m_v[None, :], b_acc, float("-inf"))
    b_max = tl.max(b_acc, 1)
    b_arg = tl.min(tl.where(b_acc == b_max[:, None], o_v[None, :], V), 1)  # the first id of the maximum
    b_sum = tl.sum(tl.exp(b_acc - b_max[:, None]), 1)
    o_part = i_v.to(tl.int64) * M + o_m
    tl.store(max_ptr + o_part, b_max, mask=m_m)
    tl.store(sum_ptr + o_part, b_sum, mask=m_m)
    tl.store(arg_ptr + o_part, b_arg, mask=m_m)


@triton.jit
def _softmax_merge_fwd_kernel(
    max_ptr, sum_ptr, arg_ptr, lse_ptr, argmax_ptr, M, V, NUM_TILES, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr
):
    """Per-tile softmax partials [NUM_TILES, M] -> lse [M] fp32 and first argmax [M] int64 of each row."""
    o_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < M
    b_top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_total = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_argmax = tl.zeros([BLOCK_M], dtype=tl.int32)
    for t0 in range(0, NUM_TILES, BLOCK_T):
        o_t = t0 + tl.arange(0, BLOCK_T)
        m_x = (o_t < NUM_TILES)[:, None] & m_m[None, :]
        o_x = o_t.to(tl.int64)[:, None] * M + o_m[None, :]
        b_max = tl.load(max_ptr + o_x, mask=m_x, other=float("-inf"))  # [BLOCK_T, BLOCK_M]
        b_sum = tl.load(sum_ptr + o_x, mask=m_x, other=0.0)
        b_arg = tl.load(arg_ptr + o_x, mask=m_x, other=V)
        b_tile_max = tl.max(b_max, 0)
        b_new = tl.maximum(b_top, b_tile_max)
        b_shift = tl.where(b_new == float("-inf"), 0.0, b_new)  # rows past M: no -inf - -inf
        b_total = b_total * tl.exp(b_top - b_shift) + tl.sum(b_sum * tl.exp(b_max - b_shift[None, :]), 0)
        # The first id of the maximum: the smallest argmax among this block's tiles that reach it; a
        # later block replaces it only when strictly greater (tiles come in increasing id order).
        b_first = tl.min(tl.where(b_max == b_tile_max[None, :], b_arg, V), 0)
        b_argmax = tl.where(b_tile_max > b_top, b_first, b_argmax)
        b_top = b_new
    tl.store(lse_ptr + o_m, b_top + tl.log(tl.where(m_m, b_total, 1.0)), mask=m_m)
    tl.store(argmax_ptr + o_m, b_argmax.to(tl.int64), mask=m_m)


@triton.jit
def _sparse_target(b_grad, b_top, ids_ptr, mass_ptr, o_n, m_n, o_v, NUM_IDS):
    """Subtract the sparse target mass at ids ([N, NUM_IDS] each) from a dlogits tile; mark the ids in b_top."""
    for j in range(NUM_IDS):
        o_id = o_n.to(tl.int64) * NUM_IDS + j
        b_id = tl.load(ids_ptr + o_id, mask=m_n, other=-1)
        b_eq = o_v[None, :] == b_id[:, None]
        b_grad -= tl.where(b_eq, tl.load(mass_ptr + o_id, mask=m_n, other=0.0)[:, None], 0.0)
        b_top = b_top | b_eq
    return b_grad, b_top


@triton.jit
def _below(b_q, b_p):
    """d min(p, q) / d q: 1 where q < p, 1/2 at a tie (torch.minimum's gradient), else 0."""
    return tl.where(b_q < b_p, 1.0, tl.where(b_q == b_p, 0.5, 0.0))


@triton.jit
def _log_mix(b_lq, b_lp):
    """log m = log((q + p) / 2) from log q and log p, shifted by their maximum: the JSD mixture."""
    b_hi = tl.maximum(b_lq, b_lp)
    return b_hi + tl.log(tl.exp(b_lq - b_hi) + tl.exp(b_lp - b_hi)) - _LOG2


@triton.jit
def _teacher_sums(b_s, b_t, b_lse_s, b_lse_t, m_x, KIND: tl.constexpr):
    """One [BLOCK_N, BLOCK_V] tile's share of its rows' teacher sums for a dense kind other than kl (which sums
    in its gradient pass), with q = e^(s - lse(s)), p = e^(t - lse(t)):
    sum p s, KL(p||q), alpha = sum min(p, q), below = sum q [q < p], and for rkl sum q (log q - log p)
    or for jsd sum q (log q - log m), sum p (log p - log m), each with its weights' sum (sum q, sum p): the
    divergence is their ratio, which cancels the rounding of lse(s) and lse(t) (absolute fp32 numbers: at
    logits in the thousands sum q is 1 only to ~1e-4, times log-ratios in the thousands); zeros for what the
    kind does not use."""
    b_lq = b_s - b_lse_s[:, None]
    b_lp = b_t - b_lse_t[:, None]
    b_q = tl.where(m_x, tl.exp(b_lq), 0.0)
    b_p = tl.where(m_x, tl.exp(b_lp), 0.0)
    b_ps = tl.sum(b_p * b_s, 1)
    b_kl = tl.sum(b_p * (b_lp - b_lq), 1)
    b_alpha = tl.sum(tl.minimum(b_p, b_q), 1)
    b_below = tl.zeros_like(b_ps)
    b_div_q = tl.zeros_like(b_ps)
    b_div_p = tl.zeros_like(b_ps)
    b_q_sum = tl.zeros_like(b_ps)
    b_p_sum = tl.zeros_like(b_ps)
    b_below = tl.sum(b_q * _below(b_q, b_p), 1)
    if KIND == "rkl":
        b_div_q = tl.sum(b_q * (b_lq - b_lp), 1)
        b_q_sum = tl.sum(b_q, 1)
    if KIND == "jsd":
        b_lm = _log_mix(b_lq, b_lp)
        b_div_q = tl.sum(b_q * (b_lq - b_lm), 1)
        b_div_p = tl.sum(b_p * (b_lp - b_lm), 1)
        b_q_sum = tl.sum(b_q, 1)
        b_p_sum = tl.sum(b_p, 1)
    return b_ps, b_kl, b_alpha, b_below, b_div_q, b_div_p, b_q_sum, b_p_sum


@triton.jit
def _dense_grad(b_s, b_t, b_lse_s, b_lse_t, b_below, b_div_q, b_tv_scale, b_lam, m_x, KIND: tl.constexpr):
    """dl/ds of one tile for a dense kind other than kl, from its rows' sums (`_teacher_sums`; b_div_q: KL(q||p)
    for rkl, KL(q||m) for jsd, each as the ratio of its sums) and `_row_scales`:
      rkl  q (log q - log p - KL(q||p)),  jsd  q (log q - log m - KL(q||m)) / 2,
      tv, lk, lk_hybrid  tv_scale q (below - [q < p]) + lam (q - p)."""
    b_lq = b_s - b_lse_s[:, None]
    b_lp = b_t - b_lse_t[:, None]
    b_q = tl.exp(b_lq)
    if KIND == "rkl":
        b_grad = b_q * (b_lq - b_lp - b_div_q[:, None])
    elif KIND == "jsd":
        b_grad = 0.5 * b_q * (b_lq - _log_mix(b_lq, b_lp) - b_div_q[:, None])
    else:
        b_p = tl.where(m_x, tl.exp(b_lp), 0.0)
        b_grad = b_tv_scale[:, None] * b_q * (b_below[:, None] - _below(b_q, b_p))
        if KIND == "lk_hybrid":
            b_grad += b_lam[:, None] * (b_q - b_p)
    return b_grad


@triton.jit
def _row_scales(b_alpha, KIND: tl.constexpr):
    """(tv_scale, lam) of the TV-family gradients: tv (1, 0); lk (1 / alpha, 0), 0 where alpha < LK_MIN_ALPHA
    (the clamp); lk_hybrid (1 - lam, lam) with lam = e^(-eta alpha)."""
    b_tv_scale = tl.full(b_alpha.shape, 1.0, tl.float32)
    b_lam = tl.zeros_like(b_alpha)
    if KIND == "lk":
        b_live = b_alpha >= _LK_MIN_ALPHA
        b_tv_scale = tl.where(b_live, 1.0 / tl.where(b_live, b_alpha, 1.0), 0.0)
    if KIND == "lk_hybrid":
        b_lam = tl.exp(b_alpha * -_LK_HYBRID_ETA)
        b_tv_scale = 1.0 - b_lam
    return b_tv_scale, b_lam


def _prune_row_tiles(configs, named_args, **kwargs):  # noqa: ARG001 (the autotuner's signature)
    """lk and rkl run without the (1, 1024) tile: compiled for sm_90 by Triton 3.9 it spills 4-8 bytes for them at
    the reference shape (bench/compile_check.py), their other two tiles do not."""
    if kwargs.get("KIND") in ("lk", "rkl"):
        return [c for c in configs if (c.kwargs["BLOCK_N"], c.kwargs["BLOCK_V"]) != (1, 1024)] or configs
    return configs


@triton.autotune(configs=_ROW_TILES, key=["V", "HAS_TEACHER", "HAS_REST", "WRITE_GRAD", "KIND"],
                 prune_configs_by={"early_config_prune": _prune_row_tiles})
@triton.jit
def _dlogits_bwd_kernel(
    logits_ptr,
    teacher_row_ptr,
    ids_ptr,
    mass_ptr,
    row_ptr,
    dlogits_ptr,
    out_ptr,
    N,
    V,
    NUM_IDS,
    HAS_TEACHER: tl.constexpr,
    HAS_REST: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    KIND: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Row sums and dl/ds of N drafter rows from the stored logits.

    logits: [*, V] fp32, drafter row n at row n, its teacher (HAS_TEACHER: a dense KIND) at row teacher_row[n];
    row: [4, N] fp32 = lse(s), lse(t), c, p_rest; ids, mass: [N, NUM_IDS] sparse target mass (stored
    top-k, or the label with mass 1). out: [7, N] fp32 (`OUT_ROWS`): with a teacher sum p s, KL(p||q), alpha,
    below (`_teacher_sums`), KL(q||p) (rkl) or KL(q||m), KL(p||m) (jsd); lse_rest = lse over the ids not in ids
    (HAS_REST).
    dlogits[n, v]: kl, ce, kl_topk: c q_v - target_v (target: the sparse mass, softmax(t) for kl, and for
    HAS_REST p_rest e^(s - lse_rest) off the ids); the other dense kinds: `_dense_grad`, after a first pass
    over the row for the sums it needs.
    """
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_s = o_n.to(tl.int64)[:, None] * V
    b_lse_s = tl.load(row_ptr + o_n, mask=m_n, other=0.0)
    b_mass = tl.load(row_ptr + 2 * N + o_n, mask=m_n, other=0.0)
    b_ps = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_kl = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_alpha = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_below = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_div_q = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_div_p = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_q_sum = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_p_sum = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_TEACHER:
        o_t = tl.load(teacher_row_ptr + o_n, mask=m_n, other=0).to(tl.int64)[:, None] * V
        b_lse_t = tl.load(row_ptr + N + o_n, mask=m_n, other=0.0)
        if KIND != "kl":  # the gradient needs the row's sums: a pass for them first
            for v0 in range(0, V, BLOCK_V):
                o_v = v0 + tl.arange(0, BLOCK_V)
                m_x = m_n[:, None] & (o_v < V)[None, :]
                b_s = tl.load(logits_ptr + o_s + o_v[None, :], mask=m_x, other=0.0)
                b_t = tl.load(logits_ptr + o_t + o_v[None, :], mask=m_x, other=0.0)
                d_ps, d_kl, d_alpha, d_below, d_div_q, d_div_p, d_q_sum, d_p_sum = _teacher_sums(
                    b_s, b_t, b_lse_s, b_lse_t, m_x, KIND
                )
                b_ps += d_ps
                b_kl += d_kl
                b_alpha += d_alpha
                b_below += d_below
                b_div_q += d_div_q
                b_div_p += d_div_p
                b_q_sum += d_q_sum
                b_p_sum += d_p_sum
            if KIND == "rkl" or KIND == "jsd":
                b_div_q = b_div_q / tl.where(m_n, b_q_sum, 1.0)
            if KIND == "jsd":
                b_div_p = b_div_p / tl.where(m_n, b_p_sum, 1.0)
            b_tv_scale, b_lam = _row_scales(b_alpha, KIND)
    if HAS_REST:
        b_max = tl.full([BLOCK_N], float("-inf"), tl.float32)
        b_sum = tl.zeros([BLOCK_N], dtype=tl.float32)
        for v0 in range(0, V, BLOCK_V):
            o_v = v0 + tl.arange(0, BLOCK_V)
            m_x = m_n[:, None] & (o_v < V)[None, :]
            b_s = tl.load(logits_ptr + o_s + o_v[None, :], mask=m_x, other=float("-inf"))
            b_none = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.int1)
            _, b_top = _sparse_target(b_s, b_none, ids_ptr, mass_ptr, o_n, m_n, o_v, NUM_IDS)
            b_s = tl.where(b_top, float("-inf"), b_s)
            b_new = tl.maximum(b_max, tl.max(b_s, 1))
            b_shift = tl.where(b_new == float("-inf"), 0.0, b_new)  # every id so far is a top-k id
            b_sum = b_sum * tl.exp(b_max - b_shift) + tl.sum(tl.exp(b_s - b_shift[:, None]), 1)
            b_max = b_new
        b_lse_r = b_max + tl.log(tl.where(b_sum > 0, b_sum, 1.0))  # -inf when every id is a top-k id
        tl.store(out_ptr + 2 * N + o_n, b_lse_r, mask=m_n)
        b_rest = tl.load(row_ptr + 3 * N + o_n, mask=m_n, other=0.0)
        b_rest = tl.where(b_lse_r == float("-inf"), 0.0, b_rest)  # no id outside the top-k: no rest term
        b_lse_r = tl.where(b_lse_r == float("-inf"), 0.0, b_lse_r)
    if WRITE_GRAD or (HAS_TEACHER and KIND == "kl"):
        for v0 in range(0, V, BLOCK_V):
            o_v = v0 + tl.arange(0, BLOCK_V)
            m_x = m_n[:, None] & (o_v < V)[None, :]
            b_s = tl.load(logits_ptr + o_s + o_v[None, :], mask=m_x, other=0.0)
            b_grad = b_mass[:, None] * tl.exp(b_s - b_lse_s[:, None])
            if HAS_TEACHER:
                b_t = tl.load(logits_ptr + o_t + o_v[None, :], mask=m_x, other=0.0)
                if KIND == "kl":  # one pass: the sums along with the gradient (b_grad is q: c = 1)
                    b_prob = tl.where(m_x, tl.exp(b_t - b_lse_t[:, None]), 0.0)
                    b_ps += tl.sum(b_prob * b_s, 1)
                    b_kl += tl.sum(b_prob * b_t, 1)  # sum p t: KL(p||q) = sum p t - lse(t) - sum p s + lse(s)
                    b_alpha += tl.sum(tl.minimum(b_prob, tl.where(m_x, b_grad, 0.0)), 1)
                    b_grad -= b_prob
                else:
                    b_grad = _dense_grad(b_s, b_t, b_lse_s, b_lse_t, b_below, b_div_q, b_tv_scale, b_lam, m_x, KIND)
            if WRITE_GRAD:
                b_none = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.int1)
                b_grad, b_top = _sparse_target(b_grad, b_none, ids_ptr, mass_ptr, o_n, m_n, o_v, NUM_IDS)
                if HAS_REST:
                    b_off = tl.where(b_top, float("-inf"), b_s - b_lse_r[:, None])  # s <= lse_rest off the ids
                    b_grad -= b_rest[:, None] * tl.exp(b_off)
                tl.store(dlogits_ptr + o_s + o_v[None, :], b_grad.to(dlogits_ptr.dtype.element_ty), mask=m_x)
    if HAS_TEACHER:
        if KIND == "kl":
            b_kl = b_kl - b_lse_t - b_ps + b_lse_s
        tl.store(out_ptr + o_n, b_ps, mask=m_n)
        tl.store(out_ptr + N + o_n, b_kl, mask=m_n)
        tl.store(out_ptr + 3 * N + o_n, b_alpha, mask=m_n)
        tl.store(out_ptr + 4 * N + o_n, b_below, mask=m_n)
        tl.store(out_ptr + 5 * N + o_n, b_div_q, mask=m_n)
        tl.store(out_ptr + 6 * N + o_n, b_div_p, mask=m_n)


@triton.jit
def _matmul_step(a_ptr, b_ptr, scale_ptr, o_m, m_m, o_c, m_c, o_k, K, stride_am, stride_ak, stride_bk,
                 HAS_SCALE: tl.constexpr):
    """One K step of `_matmul_bwd_kernel`: the a tile [BLOCK_M, BLOCK_K] and the (scaled) b tile [BLOCK_K, BLOCK_NC]."""
    m_k = o_k < K
    b_a = tl.load(
        a_ptr + o_m.to(tl.int64)[:, None] * stride_am + o_k.to(tl.int64)[None, :] * stride_ak,
        mask=m_m[:, None] & m_k[None, :],
        other=0.0,
    )
    b_b = tl.load(
        b_ptr + o_k.to(tl.int64)[:, None] * stride_bk + o_c[None, :], mask=m_k[:, None] & m_c[None, :], other=0.0
    )
    if HAS_SCALE:
        b_scale = tl.load(scale_ptr + o_k, mask=m_k, other=0.0)
        b_b = (b_b.to(tl.float32) * b_scale[:, None]).to(b_a.dtype)
    return b_a, b_b


def _markov_slice(args) -> int:
    """Columns of W2 [V, R] per program of `_matmul_bwd_kernel`: the R columns spread over the programs of a row
    tile (one per BLOCK_NC columns of the output), at least 16 (the narrowest tl.dot)."""
    programs = triton.cdiv(args["NC"], args["BLOCK_NC"])
    return max(16, triton.next_power_of_2(triton.cdiv(args["R"], programs)))


@triton.autotune(configs=_MATMUL_TILES, key=["NC", "ACCUMULATE", "HAS_SCALE", "HAS_MARKOV"],
                 restore_value=["c_ptr", "dw2_ptr"])
@triton.heuristics({"BLOCK_R": _markov_slice})
@triton.jit
def _matmul_bwd_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    scale_ptr,
    w2_ptr,
    e_ptr,
    row_scale_ptr,
    de_ptr,
    dw2_ptr,
    M,
    NC,
    K,
    R,
    stride_am,
    stride_ak,
    stride_bk,
    stride_cm,
    group_m,
    ACCUMULATE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_MARKOV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_NC: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """c[M, NC] (+)= a[M, K] @ (scale[K, None] * b[K, NC]), fp32 accumulation; b and c have unit column
    stride; programs in `_tile_order` with group_m row tiles per group.

    HAS_MARKOV (DSpark's Markov bias; a = dlogits [M, K = V] row-major, c = dxd): the programs of column tile
    i_c < cdiv(R, BLOCK_R) also take columns [i_c BLOCK_R, (i_c + 1) BLOCK_R) of W2 [K, R] and of e [M, R] and,
    from the same a tiles (one read of dlogits for all three GEMMs),
      de[m, r] = row_scale[m] sum_k a[m, k] W2[k, r]                 (de [M, R], stored in its dtype)
      dW2[k, r] += sum_m a[m, k] (row_scale[m] e[m, r])             (dW2 [K, R] fp32, an atomic add per K step:
                                                                     the M / BLOCK_M row tiles share its rows)
    The row tiles' adds land in no fixed order, so dW2 may differ in its last bits from run to run. Only the
    programs with a slice run the Markov loop: the others keep the plain loop's registers.
    """
    i_m, i_c = _tile_order(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(NC, BLOCK_NC), group_m)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_c = i_c * BLOCK_NC + tl.arange(0, BLOCK_NC)
    m_m, m_c = o_m < M, o_c < NC
    b_acc = tl.zeros([BLOCK_M, BLOCK_NC], dtype=tl.float32)
    if HAS_MARKOV and i_c * BLOCK_R < R:
        o_r = i_c * BLOCK_R + tl.arange(0, BLOCK_R)
        m_r = o_r < R
        b_row_scale = tl.load(row_scale_ptr + o_m, mask=m_m, other=0.0)
        b_e = tl.load(e_ptr + o_m.to(tl.int64)[:, None] * R + o_r[None, :], mask=m_m[:, None] & m_r[None, :], other=0.0)
        b_se = (b_e.to(tl.float32) * b_row_scale[:, None]).to(a_ptr.dtype.element_ty)  # [BLOCK_M, BLOCK_R]
        b_de = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            b_a, b_b = _matmul_step(a_ptr, b_ptr, scale_ptr, o_m, m_m, o_c, m_c, o_k, K, stride_am, stride_ak,
                                    stride_bk, HAS_SCALE)
            b_acc = tl.dot(b_a, b_b, b_acc, input_precision=DOT_PRECISION)
            m_kr = (o_k < K)[:, None] & m_r[None, :]
            o_kr = o_k.to(tl.int64)[:, None] * R + o_r[None, :]
            b_w2 = tl.load(w2_ptr + o_kr, mask=m_kr, other=0.0).to(a_ptr.dtype.element_ty)  # [BLOCK_K, BLOCK_R]
            b_de = tl.dot(b_a, b_w2, b_de, input_precision=DOT_PRECISION)
            b_dw2 = tl.dot(tl.trans(b_a), b_se, input_precision=DOT_PRECISION)  # [BLOCK_K, BLOCK_R]
            tl.atomic_add(dw2_ptr + o_kr, b_dw2, mask=m_kr, sem="relaxed")
        b_de = b_de * b_row_scale[:, None]
        p_de = de_ptr + o_m.to(tl.int64)[:, None] * R + o_r[None, :]
        tl.store(p_de, b_de.to(de_ptr.dtype.element_ty), mask=m_m[:, None] & m_r[None, :])
    else:
        for k0 in range(0, K, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            b_a, b_b = _matmul_step(a_ptr, b_ptr, scale_ptr, o_m, m_m, o_c, m_c, o_k, K, stride_am, stride_ak,
                                    stride_bk, HAS_SCALE)
            b_acc = tl.dot(b_a, b_b, b_acc, input_precision=DOT_PRECISION)
    p_out = c_ptr + o_m.to(tl.int64)[:, None] * stride_cm + o_c[None, :]
    m_out = m_m[:, None] & m_c[None, :]
    if ACCUMULATE:
        b_acc += tl.load(p_out, mask=m_out, other=0.0).to(tl.float32)
    tl.store(p_out, b_acc.to(c_ptr.dtype.element_ty), mask=m_out)


# ---------------------------------------------------------------- host functions


class Chunk(NamedTuple):
    """Drafter rows [lo, hi) and, with a full teacher, the rows of `last` they use (sorted, distinct)
    and, per drafter row, the position of its teacher row among them."""

    lo: int
    hi: int
    teacher_rows: Optional[torch.Tensor]
    teacher_of: Optional[torch.Tensor]


def chunk_rows(n: int, v: int, element_size: int, with_teacher: bool, block: int = 1,
               budget: int = CHUNK_BYTES, row_align: int = ROW_ALIGN) -> int:
    """Drafter rows per chunk: fp32 logits of the rows (and of as many teacher rows), and their dlogits,
    within `budget` bytes (CHUNK_BYTES); a power-of-two multiple of `row_align` (ROW_ALIGN) and of `block` (the
    D-PACE block). dflash_fast/train/memory.py passes the GPU's values to plan a GPU run from any machine.

    Powers of two keep the input-gradient GEMM's grid in whole waves: 1024 rows at H = 4096 are
    8 x 32 = 256 programs of 128 x 128, one wave at 2 per SM on 132 SMs (1664 rows, what the budget
    allows without a stored teacher, would be 416 programs: 1.6 waves).
    """
    align = row_align * block // math.gcd(row_align, block)
    fits = max(1, budget // (v * ((8 if with_teacher else 4) + element_size)) // align)
    return min(align << (fits.bit_length() - 1), n)


def chunk_plan(n: int, rows: int, index: Optional[torch.Tensor], num_teacher: int) -> List[Chunk]:
    """Chunks of `rows` drafter rows; with `index` [N] (the teacher row of every drafter row, < num_teacher)
    each chunk's distinct teacher rows, in one host synchronisation for the whole call."""
    bounds = [(lo, min(lo + rows, n)) for lo in range(0, n, rows)]
    if index is None:
        return [Chunk(lo, hi, None, None) for lo, hi in bounds]
    chunk_of = torch.arange(n, device=index.device) // rows
    distinct, inverse = torch.unique(chunk_of * num_teacher + index.long(), return_inverse=True)
    counts = torch.bincount(distinct // num_teacher, minlength=len(bounds)).tolist()
    plan, start = [], 0
    for c, (lo, hi) in enumerate(bounds):
        teacher_rows = distinct[start : start + counts[c]] - c * num_teacher
        plan.append(Chunk(lo, hi, teacher_rows, (inverse[lo:hi] - start).contiguous()))
        start += counts[c]
    return plan


def logits_forward(
    acts: torch.Tensor, weight: torch.Tensor, logits: torch.Tensor, n_store: int, markov: Optional[Markov] = None
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Passes 2-3: normed rows acts [M, H] -> logits[:n_store] = acts[:n_store] @ W^T (fp32), plus
    markov.e @ markov.w2^T on the first len(markov.e) rows, and lse and first argmax [M] of every row, and each
    (vocab tile, row)'s maximum [cdiv(V, LOGITS_BLOCK_V), M] (what `topk_from_tiles` reads)."""
    m, hid = acts.shape
    e, w2 = (markov.e, markov.w2) if markov is not None else (acts, weight)
    v = weight.shape[0]
    tiles = triton.cdiv(v, LOGITS_BLOCK_V)
    part_max = torch.empty(tiles, m, dtype=torch.float32, device=acts.device)
    part_sum = torch.empty_like(part_max)
    part_arg = torch.empty(tiles, m, dtype=torch.int32, device=acts.device)
    _logits_fwd_kernel[lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * tiles,)](
        acts,
        weight,
        e,
        w2,
        logits,
        part_max,
        part_sum,
        part_arg,
        m,
        v,
        hid,
        e.shape[1],
        n_store,
        e.shape[0] if markov is not None else 0,
        weight.stride(0),
        w2.stride(0),
        m,  # group_m: every row tile of a vocab tile in one group; a chunk's rows fit in L2
        HAS_BIAS=markov is not None,
        DOT_PRECISION=dot_precision(acts.dtype),
        BLOCK_V=LOGITS_BLOCK_V,
    )
    lse = torch.empty(m, dtype=torch.float32, device=acts.device)
    argmax = torch.empty(m, dtype=torch.int64, device=acts.device)
    block_m, block_t = (128, 32) if ON_GPU else (64, 64)
    _softmax_merge_fwd_kernel[(triton.cdiv(m, block_m),)](
        part_max, part_sum, part_arg, lse, argmax, m, v, tiles, BLOCK_M=block_m, BLOCK_T=block_t
    )
    return lse, argmax, part_max


def topk_from_tiles(logits: torch.Tensor, tile_max: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's top-k ids [C, k] (best first) of logits [C, V] (fp32) from its tile maxima tile_max [tiles, C]
    (tiles of LOGITS_BLOCK_V ids, `logits_forward`): only the row's k tiles with the largest maxima are read. Exact:
    a tile holding one of the row's k largest values has its maximum at least that value, and fewer than k other
    tiles can have a larger maximum (each holds a value above it), so the k largest tile maxima cover the top-k
    (the same values; equal values may be taken in another order than torch.topk over the row takes them).
    Reads C x k x LOGITS_BLOCK_V logits (and a ragged last tile's) and the C x tiles maxima instead of the C x V
    row: 1/74 of it at V = 151936 (1187 whole tiles), k = 16."""
    c, v = logits.shape
    tiles, width = tile_max.shape[0], LOGITS_BLOCK_V
    if tiles <= k:
        return logits.topk(k, dim=-1).indices
    whole = v // width  # whole tiles; a ragged last one (v % width ids) is always read: it is narrower than a tile
    best = tile_max[:whole].t().topk(k, dim=-1).indices  # [C, k]: with the ragged tile, a superset of the k best
    rows = torch.arange(c, device=logits.device)[:, None]
    values = logits[:, : whole * width].view(c, whole, width)[rows, best].flatten(1)  # [C, k x width]
    if whole < tiles:
        values = torch.cat([values, logits[:, whole * width :]], 1)
    top = values.topk(k, dim=-1).indices
    in_tiles = best.gather(1, (top // width).clamp(max=k - 1)) * width + top % width
    return torch.where(top < k * width, in_tiles, top - k * width + whole * width)


def dlogits_backward(
    logits: torch.Tensor,
    teacher_of: Optional[torch.Tensor],
    ids: torch.Tensor,
    mass: torch.Tensor,
    rows: torch.Tensor,
    dlogits: Optional[torch.Tensor],
    has_rest: bool,
    kind: str,
) -> torch.Tensor:
    """Pass 4 over the chunk's stored logits [>= N, V]; rows [4, N], ids and mass [N, k] as in `_dlogits_bwd_kernel`.

    teacher_of: [N] row of logits holding each drafter row's teacher (the dense kinds), or None; dlogits: the
    [N, V] chunk to write, or None. Returns [OUT_ROWS, N] fp32 as the kernel's out (rows it does not write
    are undefined).
    """
    n = rows.shape[1]
    v = logits.shape[1]
    out = torch.empty(OUT_ROWS, n, dtype=torch.float32, device=logits.device)
    _dlogits_bwd_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](
        logits,
        teacher_of if teacher_of is not None else ids,
        ids,
        mass,
        rows,
        dlogits if dlogits is not None else logits,
        out,
        n,
        v,
        ids.shape[1],
        HAS_TEACHER=teacher_of is not None,
        HAS_REST=has_rest,
        WRITE_GRAD=dlogits is not None,
        KIND=kind,
    )
    return out


class MarkovGrads(NamedTuple):
    """The Markov bias's share of pass 6: e [M, r] and w2 [V, r] (contiguous), the rows' w/denom [M]; de [M, r]
    to write and dw2 [V, r] fp32 to add to."""

    e: torch.Tensor
    w2: torch.Tensor
    row_scale: torch.Tensor
    de: torch.Tensor
    dw2: torch.Tensor


def matmul_backward(
    a: torch.Tensor,
    a_strides: Tuple[int, int],
    b: torch.Tensor,
    c: torch.Tensor,
    accumulate: bool,
    group_m: int,
    scale: Optional[torch.Tensor] = None,
    markov: Optional[MarkovGrads] = None,
) -> None:
    """Pass 6: c[M, NC] (+)= a[M, K] @ (scale[:, None] * b[K, NC]); a given by its (row, column) strides.
    With `markov` (a = dlogits, row-major) also markov.de = row_scale * a @ w2 and markov.dw2 += a^T @
    (row_scale * e), from the same reads of a (`_matmul_bwd_kernel`, HAS_MARKOV)."""
    m, nc = c.shape
    k = b.shape[0]
    # Without the Markov bias dw2 is an empty view: the autotuner's restore_value copy of it costs nothing (c may
    # be the [V, H] fp32 dW accumulator).
    e, w2, row_scale, de, dw2 = markov if markov is not None else (c, b, c, c, c[:0])
    _matmul_bwd_kernel[lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(nc, meta["BLOCK_NC"]),)](
        a,
        b,
        c,
        scale if scale is not None else c,
        w2,
        e,
        row_scale,
        de,
        dw2,
        m,
        nc,
        k,
        e.shape[1] if markov is not None else 0,
        a_strides[0],
        a_strides[1],
        b.stride(0),
        c.stride(0),
        group_m,
        ACCUMULATE=accumulate,
        HAS_SCALE=scale is not None,
        HAS_MARKOV=markov is not None,
        DOT_PRECISION=dot_precision(a.dtype),
    )


class Target(NamedTuple):
    """What a chunk's rows are scored against: label [C] (teacher_argmax), sparse target ids, mass [C, k],
    rows [4, C] = lse(s), lse(t), c, p_rest (see `_dlogits_bwd_kernel`); teacher_of [C] or None."""

    label: torch.Tensor
    ids: torch.Tensor
    mass: torch.Tensor
    rows: torch.Tensor
    teacher_of: Optional[torch.Tensor]


def chunk_target(
    kind: str, teacher: Teacher, chunk: Chunk, lse: torch.Tensor, argmax: torch.Tensor, v: int
) -> Target:
    """The target of the chunk's c = hi - lo rows from the merged statistics of [drafter rows ; teacher rows]
    (V = v ids; a stored label outside them scores against the nearest id, as in the eager twin)."""
    lo, hi = chunk.lo, chunk.hi
    c = hi - lo
    lse_s, device = lse[:c], lse.device
    ones, zeros = torch.ones_like(lse_s), torch.zeros_like(lse_s)
    no_ids = torch.zeros(c, 0, dtype=torch.int64, device=device)
    if chunk.teacher_of is not None:  # a dense kind, or ce against argmax(t): teacher rows follow the drafter rows
        teacher_of = chunk.teacher_of + c
        label = argmax[teacher_of]
        if kind in DENSE_KINDS:
            rows = torch.stack([lse_s, lse[teacher_of], ones, zeros])
            return Target(label, no_ids, no_ids.float(), rows, teacher_of)
        rows = torch.stack([lse_s, zeros, ones, zeros])
        return Target(label, label.clamp(0, v - 1)[:, None].contiguous(), ones[:, None], rows, None)
    if kind in ("ce", "ce_data"):
        label = teacher.labels[lo:hi].long()
        ids = label.clamp(0, v - 1)[:, None].contiguous()
        return Target(label, ids, ones[:, None], torch.stack([lse_s, zeros, ones, zeros]), None)
    ids = teacher.topk_ids[lo:hi].long().contiguous()
    p = torch.exp(teacher.topk_logits[lo:hi].float() - teacher.topk_lse[lo:hi].float()[:, None]).contiguous()
    p_rest = (1 - p.sum(-1)).clamp(min=0)
    return Target(ids[:, 0], ids, p, torch.stack([lse_s, zeros, p.sum(-1) + p_rest, p_rest]), None)


def row_losses(kind: str, target: Target, s_label: torch.Tensor, s_ids: torch.Tensor, sums: Optional[torch.Tensor]):
    """Per-row loss [C], KL [C] or None, and alpha [C] (`LossOutput`) from the chunk's statistics; s_label = s at
    target.label, s_ids = s at target.ids [C, k], sums from `dlogits_backward` (None for ce and ce_data)."""
    lse_s = target.rows[0]
    if kind in DENSE_KINDS:  # the formulas of eager.dense_row_losses
        kl, alpha = sums[1], sums[3]
        if kind == "kl":
            per_row = lse_s - sums[0]
        elif kind == "tv":
            per_row = 1 - alpha
        elif kind == "lk":
            per_row = -alpha.clamp_min(LK_MIN_ALPHA).log()
        elif kind == "lk_hybrid":
            lam = torch.exp(-LK_HYBRID_ETA * alpha)
            per_row = lam * kl + (1 - lam) * (1 - alpha)
        elif kind == "rkl":
            per_row = sums[5]
        else:
            per_row = 0.5 * (sums[5] + sums[6])
        return per_row, kl, alpha
    if kind in ("ce", "ce_data"):
        return lse_s - s_label, None, torch.exp(s_label - lse_s)
    p, p_rest = target.mass, target.rows[3]
    zeros = torch.zeros_like(lse_s)
    rest_ok = (p_rest > 0) & torch.isfinite(sums[2])
    per_row = -((p * (s_ids - lse_s[:, None])).sum(-1) + torch.where(rest_ok, p_rest * (sums[2] - lse_s), zeros))
    plogp = torch.where(p > 0, p * p.clamp(min=1e-38).log(), torch.zeros_like(p)).sum(-1)
    plogp = plogp + torch.where(p_rest > 0, p_rest * p_rest.clamp(min=1e-38).log(), zeros)
    q_rest = torch.where(torch.isfinite(sums[2]), torch.exp(sums[2] - lse_s), zeros)  # no id left: no rest bucket
    alpha = torch.minimum(p, torch.exp(s_ids - lse_s[:, None])).sum(-1) + torch.minimum(p_rest, q_rest)
    return per_row, plogp + per_row, alpha


def lm_head_loss_forward(h, norm_weight, lm_head_weight, weights, kind, normalizer, eps, teacher, dpace=None,
                         markov=None, need_grads=(False, False, False, False, False), topk=0):
    """Loss, metrics and, for the inputs flagged in need_grads (h, norm_weight, lm_head_weight, markov.e,
    markov.w2), d loss.

    Arguments (types, shapes) as in `lm_head_loss`. Returns (loss [], kl [] or None, draft_argmax [N],
    teacher_argmax [N], alpha [N] fp32, topk_ids [N, topk] or None, topk_logits [N, topk] fp32 or None, topk_lse
    [N] fp32 or None, grads):
    alpha is each row's acceptance estimate (`LossOutput`, the DSpark confidence target); topk_ids each row's `topk`
    best logits' ids, taken from the chunk's logits buffer (DFlash2's unary candidates: [C, V] at a time, never
    [N, V]), only the tiles whose maxima can hold them read (`topk_from_tiles`), topk_logits their logits and
    topk_lse each row's log-sum-exp (the softmax merge's, LiLiCorr's log-probabilities); grads
    the gradients of h [N, H], norm_weight [H], lm_head_weight [V, H], markov.e [N, r], markov.w2 [V, r], each None
    when not flagged.
    """
    check_loss_inputs(h, norm_weight, lm_head_weight, weights, kind, teacher, dpace, markov)
    check_device("lm_head_loss", h, lm_head_weight)
    h, weight = h.contiguous(), lm_head_weight if lm_head_weight.stride(1) == 1 else lm_head_weight.contiguous()
    n, hid = h.shape
    v, device = weight.shape[0], h.device
    full = needs_last(kind, teacher.labels is not None)
    need_dx, need_any = need_grads[0] or need_grads[1], any(need_grads)
    dense = kind in DENSE_KINDS  # the chunk keeps its teacher rows' logits too
    rows = chunk_rows(n, v, h.element_size(), dense, dpace.block_size if dpace else 1)
    index = None
    if full:
        index = teacher.index if teacher.index is not None else torch.arange(n, device=device)
    plan = chunk_plan(n, rows, index, teacher.last.shape[0] if full else 0)
    teacher_max = max((len(c.teacher_rows) for c in plan if c.teacher_rows is not None), default=0)
    logits_buf = torch.empty(rows + (teacher_max if dense else 0), v, dtype=torch.float32, device=device)
    dlogits_buf = torch.empty(rows, v, dtype=h.dtype, device=device) if need_any else None
    denom = torch.as_tensor(normalizer, dtype=torch.float32, device=device).clamp(min=1)
    per_row = torch.empty(n, dtype=torch.float32, device=device)
    kl_row = torch.empty(n, dtype=torch.float32, device=device) if has_kl(kind) else None
    alpha = torch.empty(n, dtype=torch.float32, device=device)
    row_weight = weights.float().clone()
    draft_argmax = torch.empty(n, dtype=torch.int64, device=device)
    teacher_argmax = torch.empty(n, dtype=torch.int64, device=device)
    topk_ids = torch.empty(n, topk, dtype=torch.int64, device=device) if topk else None
    topk_logits = torch.empty(n, topk, dtype=torch.float32, device=device) if topk else None
    topk_lse = torch.empty(n, dtype=torch.float32, device=device) if topk else None
    grad_h = torch.empty_like(h) if need_grads[0] else None
    grad_norm = torch.zeros(hid, dtype=torch.float32, device=device) if need_grads[1] else None
    grad_head = torch.zeros(v, hid, dtype=torch.float32, device=device) if need_grads[2] else None
    r = 0
    if markov is not None:
        markov = Markov(markov.e.contiguous(), markov.w2.contiguous())
        r = markov.e.shape[1]
    grad_e = torch.empty(n, r, dtype=h.dtype, device=device) if need_grads[3] else None
    grad_w2 = torch.zeros(v, r, dtype=torch.float32, device=device) if need_grads[4] else None
    for chunk in plan:
        lo, hi = chunk.lo, chunk.hi
        c = hi - lo
        xd, rstd = rms_norm_forward(h[lo:hi], norm_weight, eps)
        acts = xd
        if full:
            xt = rms_norm_forward(teacher.last[chunk.teacher_rows].contiguous(), teacher.final_norm_weight, eps)[0]
            acts = torch.cat([xd, xt])
        n_store = acts.shape[0] if dense else c
        logits = logits_buf[:n_store]
        chunk_markov = None if markov is None else Markov(markov.e[lo:hi], markov.w2)
        lse, argmax, tile_max = logits_forward(acts, weight, logits, n_store, chunk_markov)
        if topk_ids is not None:
            topk_ids[lo:hi] = topk_from_tiles(logits[:c], tile_max[:, :c], topk)
            topk_logits[lo:hi] = logits[:c].gather(1, topk_ids[lo:hi])
            topk_lse[lo:hi] = lse[:c]
        target = chunk_target(kind, teacher, chunk, lse, argmax, v)
        dlogits = dlogits_buf[:c] if need_any else None
        sums = None
        if dlogits is not None or has_kl(kind):  # the soft targets' losses need the row sums
            sums = dlogits_backward(
                logits, target.teacher_of, target.ids, target.mass, target.rows, dlogits, kind == "kl_topk", kind
            )
        label = target.label.clamp(0, v - 1)
        s_label = logits[:c].gather(1, label[:, None])[:, 0]
        per_row[lo:hi], kl, alpha[lo:hi] = row_losses(kind, target, s_label, logits[:c].gather(1, target.ids), sums)
        if kl is not None:
            kl_row[lo:hi] = kl
        if dpace is not None:
            confidence = torch.exp(s_label - target.rows[0])
            row_weight[lo:hi] *= dpace_weights(confidence, row_weight[lo:hi] > 0, dpace)
        draft_argmax[lo:hi] = argmax[:c]
        teacher_argmax[lo:hi] = target.label
        if not need_any:
            continue
        row_scale = (row_weight[lo:hi] / denom).contiguous()
        chunk_grads = None
        if grad_e is not None or grad_w2 is not None:  # either output needs the kernel's both: scratch for the other
            chunk_grads = MarkovGrads(
                chunk_markov.e,
                markov.w2,
                row_scale,
                grad_e[lo:hi] if grad_e is not None else torch.empty(c, r, dtype=h.dtype, device=device),
                grad_w2 if grad_w2 is not None else torch.zeros(v, r, dtype=torch.float32, device=device),
            )
        if need_dx or chunk_grads is not None:
            # dxd, and with DSpark's Markov bias de and dW2 from the same reads of dlogits
            dxd = torch.empty(c, hid, dtype=torch.float32, device=device)
            matmul_backward(dlogits, (v, 1), weight, dxd, accumulate=False, group_m=c, markov=chunk_grads)
            if need_dx:
                dh_chunk, dnorm_chunk = rms_norm_backward(h[lo:hi], norm_weight.float(), rstd, dxd, row_scale)
                if grad_h is not None:
                    grad_h[lo:hi] = dh_chunk
                if grad_norm is not None:
                    grad_norm += dnorm_chunk
        if grad_head is not None:
            # One row tile of dW for every column tile first (group 1): each dlogits tile is read once.
            matmul_backward(dlogits, (1, v), xd, grad_head, accumulate=lo > 0, group_m=1, scale=row_scale)
    loss = (per_row * row_weight).sum() / denom
    kl = None if kl_row is None else (kl_row * row_weight).sum() / denom
    grads = (
        grad_h,
        None if grad_norm is None else grad_norm.to(norm_weight.dtype),
        None if grad_head is None else grad_head.to(weight.dtype),
        grad_e,
        None if grad_w2 is None else grad_w2.to(markov.w2.dtype),
    )
    return loss, kl, draft_argmax, teacher_argmax, alpha, topk_ids, topk_logits, topk_lse, grads


def lm_head_loss_backward(grad_loss: torch.Tensor, grads):
    """Scale the unit gradients from lm_head_loss_forward by d(outer)/d loss (a scalar)."""
    return tuple(None if grad is None else grad * grad_loss.to(grad.dtype) for grad in grads)


class LmHeadLossFunction(torch.autograd.Function):
    """The gradients come out of the forward (the loss is the final scalar); backward scales them.
    Arguments: h, norm_weight, lm_head_weight, markov.e, markov.w2 (None without DSpark's Markov bias), topk, then
    the rest of `lm_head_loss`'s. Outputs: loss, kl, draft_argmax, teacher_argmax, alpha, topk_ids, topk_logits
    ([N, 0] without topk), topk_lse ([0] without topk)."""

    @staticmethod
    def forward(ctx, h, norm_weight, lm_head_weight, e, w2, topk, *rest):
        markov = None if e is None else Markov(e, w2)
        loss, kl, draft_argmax, teacher_argmax, alpha, topk_ids, topk_logits, topk_lse, grads = lm_head_loss_forward(
            h, norm_weight, lm_head_weight, *rest, markov=markov, need_grads=tuple(ctx.needs_input_grad[:5]),
            topk=topk,
        )
        ctx.grads = grads
        kl = kl if kl is not None else loss.new_zeros(())
        topk_ids = topk_ids if topk_ids is not None else draft_argmax.new_empty(draft_argmax.shape[0], 0)
        topk_logits = topk_logits if topk_logits is not None else alpha.new_empty(alpha.shape[0], 0)
        topk_lse = topk_lse if topk_lse is not None else alpha.new_empty(0)
        ctx.mark_non_differentiable(kl, draft_argmax, teacher_argmax, alpha, topk_ids, topk_logits, topk_lse)
        return loss, kl, draft_argmax, teacher_argmax, alpha, topk_ids, topk_logits, topk_lse

    @staticmethod
    def backward(ctx, grad_loss, *_):
        return lm_head_loss_backward(grad_loss, ctx.grads) + (None,) * (len(ctx.needs_input_grad) - 5)


def lm_head_loss(
    h: torch.Tensor,
    norm_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    weights: torch.Tensor,
    kind: str,
    normalizer: Union[float, torch.Tensor],
    eps: float,
    teacher: Teacher,
    dpace: Optional[DPace] = None,
    markov: Optional[Markov] = None,
    topk: int = 0,
) -> LossOutput:
    """Drafter norm + lm_head + loss against the teacher (spec.md §5) without [N, V] logits.

    h: [N, H] drafter pre-norm states; norm_weight: [H]; lm_head_weight: [V, H] (gets a gradient
    only if it requires grad); weights: [N]; teacher: `dflash_fast.drafter.losses.Teacher`; dpace: D-PACE
    weights or None; markov: DSpark's Markov bias (`dflash_fast.drafter.losses.Markov`: e [N, r], w2 [V, r]), folded
    into the lm_head GEMM as r more columns, with gradients for e and w2. Semantics and kinds exactly as
    `dflash_fast.drafter.eager.lm_head_loss`; logits are accumulated in fp32. topk > 0 (DFlash2's unary candidates,
    spec.md §9): each row's top-`topk` ids and their logits (fp32, no gradient), from each chunk's logits as the pass
    computes them.
    """
    e, w2 = (markov.e, markov.w2) if markov is not None else (None, None)
    grad_inputs = [t for t in (h, norm_weight, lm_head_weight, e, w2) if t is not None]
    rest = (weights, kind, normalizer, eps, teacher, dpace)
    if torch.is_grad_enabled() and any(t.requires_grad for t in grad_inputs):
        loss, kl, draft_argmax, teacher_argmax, alpha, topk_ids, topk_logits, topk_lse = LmHeadLossFunction.apply(
            h, norm_weight, lm_head_weight, e, w2, topk, *rest
        )
    else:  # the autograd Function would still see requires_grad under no_grad and compute gradients
        loss, kl, draft_argmax, teacher_argmax, alpha, topk_ids, topk_logits, topk_lse, _ = lm_head_loss_forward(
            h, norm_weight, lm_head_weight, *rest, markov=markov, topk=topk
        )
    return LossOutput(loss, kl if has_kl(kind) else None, draft_argmax, teacher_argmax, alpha,
                      *((topk_ids, topk_logits, topk_lse) if topk else ()))
