"""Fused drafter norm + lm_head + loss against the teacher (SPEC §5) that never builds [N, V] logits.

Same signature, result and semantics as `dflash_fast.eager.lm_head_loss`; the
gradients (dh, d norm_weight, and d lm_head_weight when it requires grad) are
computed during the forward, because the loss is the final scalar: backward only
scales them by the incoming gradient.

Math (per row n; s = drafter logits, t = teacher logits, both fp32-accumulated):
    xd = rms_norm(h, norm_weight), xt = rms_norm(last, final_norm_weight)  [N, H]
    s_v = xd . W_v,  t_v = xt . W_v,  lse(s) = log sum_v exp(s_v)
    kl      l = lse(s) - sum_v p_v s_v, p = softmax(t); KL = sum p (t - s) - lse(t) + lse(s)
    ce      l = lse(s) - s_y, y = stored label or argmax(t)
    ce_data l = lse(s) - s_y, y = dataset label
    kl_topk l = -(sum_i p_i (s_{id_i} - lse(s)) + p_rest (lse_{v not in ids}(s) - lse(s)))
    dl/ds_v = c q_v - target_v, q = softmax(s), c = sum of the target mass (1 except kl_topk)

Passes (each lm_head tile [BLOCK_V, BLOCK_K] is loaded once for drafter AND teacher):
  0. `rms_norm_forward` (kernels/_common.py): xd (and xt) in the input dtype plus rstd [N]: O(N*H).
  1. `_vocab_stats_kernel`, grid (row tiles, vocab splits): streams its slice of
     the vocabulary in tiles and keeps online statistics per row: running max and
     sum of exp for s (and t, and s restricted to non-top-k ids), sum_v e^(t-m) s_v
     and sum_v e^(t-m) t_v, and both argmaxes (first index on ties). Output:
     10 floats + 2 ints per (split, row), merged on the host in O(S*N).
  2. `_gather_logits_kernel`: s at the label / top-k ids, O(N*k*H).
  3. Gradient, only when an input requires grad, for each vocabulary chunk of
     VOCAB_CHUNK ids: `_dlogits_kernel` recomputes the s (and t) tiles and writes
     dl/ds = c q - target, formed in fp32 BEFORE rounding to the input dtype (so
     the q - p cancellation keeps its precision), into a [N, VOCAB_CHUNK]
     buffer; `_matmul_kernel` then adds dlogits @ W_chunk into dxd [N, H] (fp32)
     and writes d W_chunk = dlogits^T @ (w/denom * xd). `rms_norm_backward`
     turns dxd into dh and d norm_weight.

Two gradient strategies for the kinds with a full teacher (kl, and ce against
argmax(t)); the other kinds have no teacher GEMM to save and always recompute.
  recompute (the default): passes 1-3 above.
  store: replaces passes 1-3 when a gradient is needed; for each chunk of
     `_store_rows` rows (1024 at V = 151936 in bf16 on a GPU, 16 under the interpreter):
     `_store_logits_kernel` writes s and t of the chunk as fp32 [C, V];
     `_stored_dlogits_kernel` reads them twice per row: once for the statistics of
     pass 1 (same online max / sum-exp / first-index argmax), once to write
     dl/ds = q - p (p = softmax(t), or the one-hot of argmax(t) for ce), formed
     in fp32 before rounding, into a [C, V] chunk in the input dtype (without
     w/denom, as in pass 3, which would push fp16 entries into underflow); then
     `_matmul_kernel` writes dxd[chunk] = dlogits @ W (K = V) and adds
     dlogits^T @ (w/denom * xd[chunk]) into an fp32 d W accumulator.
  A call that needs no gradient runs pass 1 alone (2 GEMMs) under either strategy.
  The default stays `recompute` until a GPU measures both (bench_lm_head_loss.py
  runs them side by side); pick per call with `strategy=` or for the process with
  DFLASH_LM_HEAD_STRATEGY=recompute|store.

FLOPs (one "GEMM" = 2 N V H, ~10 TFLOP at N=8192, H=4096, V=151936):
  kl (full teacher): 2 (pass 1: s, t) + 2 (recompute s, t) + 1 (dxd) = 5 GEMMs (+1 for d lm_head)
  kl or ce with teacher, store: 2 (s, t) + 1 (dxd) = 3 GEMMs (+1), plus memory traffic
    at N = 8192 in bf16: s, t written once and read twice (30 GB), dlogits (5 GB), W
    read twice per chunk (20 GB): ~55 GB, ~11 ms at 4.8 TB/s, against ~30 ms of GEMMs saved
  ce with stored labels, ce_data, kl_topk: 1 + 1 + 1 = 3 GEMMs (+1); ce with teacher: 4 (+1)
  eager: kl 3 (+1), ce 2 (+1), but it streams [N, V] fp32 tensors a dozen times.
Why recompute rather than accumulate sum_v q_v W_v online during pass 1 (flash-
attention style, 1 GEMM less): the two running sums q W and p W are each ~|W|
while their difference (the gradient) goes to 0 as the drafter learns; rounding
each to bf16 before the GEMM would give the large relative gradient error that
materialised-bf16 losses have. And the accumulator is [N, H] wide (H = 4096),
so it cannot live in registers: every tile would read-modify-write it.

Memory beyond inputs and outputs: xd, xt [N, H]; stats [10, S, N]; dxd [N, H]
fp32; one dlogits chunk [N, VOCAB_CHUNK] in the input dtype (128 MB at N = 8192
in bf16), reused for every chunk. Never O(N * V). The chunk exists so that the
dxd GEMM reduces over VOCAB_CHUNK ids in registers: fusing it into the tile
kernel would read-modify-write the fp32 [N, H] dxd once per 128-id tile
(~160 GB of traffic at the reference shape). The store strategy instead holds
s, t [C, V] fp32 and one dlogits [C, V] chunk (STORE_CHUNK_BYTES, ~1.5 GB in all),
O(C * V) whatever N is, and, when lm_head trains, an fp32 d W accumulator [V, H]
(2.5 GB; summing the row chunks in bf16 would round d W once per chunk).
Offsets that scale with N*V, C*V, V*H or N*H are int64: at N = 8192, V = 151936
the product N*V is already 1.2e9.
"""
import os
from typing import Optional, Tuple, Union

import torch
import triton
import triton.language as tl
from dflash_fast.kernels._common import (
    ON_GPU,
    autotune_configs,
    dot_precision,
    rms_norm_backward,
    rms_norm_forward,
    sm_count,
)

from dflash_fast.eager import LOSS_KINDS, LossOutput

# Big tiles under the interpreter, where every program iteration costs milliseconds.
VOCAB_CHUNK = 8192 if ON_GPU else 256
_STAT_FIELDS = 10  # m_s, l_s, best_s, m_t, l_t, a_ts, a_tt, best_t, m_rest, l_rest
STRATEGIES = ("recompute", "store")
# Bytes of the store strategy's per-chunk buffers (s, t fp32 and dlogits): 1024 rows at V = 151936 in bf16.
STORE_CHUNK_BYTES = 3 << 29 if ON_GPU else 1 << 16


_LOGIT_TILES = autotune_configs(
    ("BLOCK_N", "BLOCK_V", "BLOCK_K"),
    [(128, 128, 64, 8, 3), (64, 128, 64, 4, 4), (128, 256, 64, 8, 3), (64, 256, 64, 8, 4)],
    (64, 128, 64, 4, 1),
)
_MATMUL_TILES = autotune_configs(
    ("BLOCK_M", "BLOCK_NC", "BLOCK_K"),
    [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4)],
    (64, 64, 64, 4, 1),
)
_ROW_TILES = autotune_configs(
    ("BLOCK_N", "BLOCK_V"),
    [(1, 4096, 8, 2), (1, 2048, 4, 2), (4, 1024, 4, 2), (4, 2048, 8, 2)],  # (8, 2048) spills on sm_90
    (16, 256, 4, 1),
)


@triton.jit
def _logit_tiles(
    xd_ptr, xt_ptr, w_ptr, o_n, m_n, o_v, m_v, H, stride_w,
    HAS_TEACHER: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """s = xd[o_n] @ W[o_v]^T and t = xt[o_n] @ W[o_v]^T as fp32 [BLOCK_N, BLOCK_V], one W load for both."""
    o_x = o_n.to(tl.int64)[:, None] * H
    o_w = o_v.to(tl.int64)[None, :] * stride_w
    b_s = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    b_t = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < H
        b_w = tl.load(w_ptr + o_w + o_k[:, None], mask=m_k[:, None] & m_v[None, :], other=0.0)  # [BLOCK_K, BLOCK_V]
        m_x = m_n[:, None] & m_k[None, :]
        b_xd = tl.load(xd_ptr + o_x + o_k[None, :], mask=m_x, other=0.0)
        b_s = tl.dot(b_xd, b_w, b_s, input_precision=DOT_PRECISION)
        if HAS_TEACHER:
            b_xt = tl.load(xt_ptr + o_x + o_k[None, :], mask=m_x, other=0.0)
            b_t = tl.dot(b_xt, b_w, b_t, input_precision=DOT_PRECISION)
    return b_s, b_t


@triton.jit
def _online_lse(b_m, b_l, b_x):
    """Fold a [BLOCK_N, BLOCK_V] tile (-inf where excluded) into running max b_m and sum b_l = sum e^(x - b_m)."""
    b_m_new = tl.maximum(b_m, tl.max(b_x, 1))
    # A row whose columns are all excluded so far keeps max -inf; shift by 0 to avoid -inf - -inf.
    b_shift = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
    b_l = b_l * tl.exp(b_m - b_shift) + tl.sum(tl.exp(b_x - b_shift[:, None]), 1)
    return b_m_new, b_l


@triton.jit
def _online_argmax(b_best, b_arg, b_x, v0):
    """Running max and its first index; tiles come in increasing vocab order, so strict > keeps the first tie."""
    b_max, b_idx = tl.max(b_x, 1, return_indices=True, return_indices_tie_break_left=True)
    b_new = b_max > b_best
    return tl.where(b_new, b_max, b_best), tl.where(b_new, v0 + b_idx, b_arg)


@triton.jit
def _online_teacher(b_m, b_l, b_a_ts, b_a_tt, b_t_in, b_s, b_t):
    """Fold a tile into running max b_m of t, b_l = sum e^(t - b_m), b_a_ts = sum e^(t - b_m) s,
    b_a_tt = sum e^(t - b_m) t.

    b_t_in is t with -inf on excluded columns, where b_s and b_t must be finite (0).
    """
    b_m_new = tl.maximum(b_m, tl.max(b_t_in, 1))
    b_alpha = tl.exp(b_m - b_m_new)
    b_p = tl.exp(b_t_in - b_m_new[:, None])
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    b_a_ts = b_a_ts * b_alpha + tl.sum(b_p * b_s, 1)
    b_a_tt = b_a_tt * b_alpha + tl.sum(b_p * b_t, 1)
    return b_m_new, b_l, b_a_ts, b_a_tt


@triton.autotune(configs=_LOGIT_TILES, key=["H", "HAS_TEACHER", "HAS_REST"])
@triton.jit
def _vocab_stats_kernel(
    xd_ptr,
    xt_ptr,
    w_ptr,
    ids_ptr,
    stats_ptr,
    arg_ptr,
    N,
    V,
    H,
    NUM_IDS,
    V_PER_SPLIT,
    stride_w,
    HAS_TEACHER: tl.constexpr,
    HAS_REST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Online statistics of one (row tile, vocab split): stats [10, S, N] fp32, arg [2, S, N] int64.

    ids: [N, NUM_IDS] top-k ids excluded from the "rest" statistics (HAS_REST).
    """
    i_n, i_s = tl.program_id(0), tl.program_id(1)
    n_splits = tl.num_programs(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    v_lo = i_s * V_PER_SPLIT
    v_hi = tl.minimum(v_lo + V_PER_SPLIT, V)
    b_m_s = tl.full([BLOCK_N], float("-inf"), tl.float32)
    b_l_s = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_best_s = tl.full([BLOCK_N], float("-inf"), tl.float32)
    b_arg_s = tl.zeros([BLOCK_N], dtype=tl.int32)
    b_m_t, b_l_t, b_best_t, b_arg_t = b_m_s, b_l_s, b_best_s, b_arg_s
    b_a_ts, b_a_tt = b_l_s, b_l_s
    b_m_r, b_l_r = b_m_s, b_l_s
    for v0 in range(v_lo, v_hi, BLOCK_V):
        o_v = v0 + tl.arange(0, BLOCK_V)
        m_v = o_v < v_hi
        b_s, b_t = _logit_tiles(
            xd_ptr,
            xt_ptr,
            w_ptr,
            o_n,
            m_n,
            o_v,
            m_v,
            H,
            stride_w,
            HAS_TEACHER,
            DOT_PRECISION,
            BLOCK_N,
            BLOCK_V,
            BLOCK_K,
        )
        b_s_in = tl.where(m_v[None, :], b_s, float("-inf"))
        b_m_s, b_l_s = _online_lse(b_m_s, b_l_s, b_s_in)
        b_best_s, b_arg_s = _online_argmax(b_best_s, b_arg_s, b_s_in, v0)
        if HAS_TEACHER:
            b_t_in = tl.where(m_v[None, :], b_t, float("-inf"))  # s, t are 0 on excluded columns
            b_m_t, b_l_t, b_a_ts, b_a_tt = _online_teacher(b_m_t, b_l_t, b_a_ts, b_a_tt, b_t_in, b_s, b_t)
            b_best_t, b_arg_t = _online_argmax(b_best_t, b_arg_t, b_t_in, v0)
        if HAS_REST:
            b_top = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.int1)
            for j in range(NUM_IDS):
                b_id = tl.load(ids_ptr + o_n.to(tl.int64) * NUM_IDS + j, mask=m_n, other=-1)
                b_top = b_top | (o_v[None, :] == b_id[:, None])
            b_m_r, b_l_r = _online_lse(b_m_r, b_l_r, tl.where(b_top, float("-inf"), b_s_in))
    o_stat = stats_ptr + i_s.to(tl.int64) * N + o_n
    plane = n_splits.to(tl.int64) * N
    tl.store(o_stat, b_m_s, mask=m_n)
    tl.store(o_stat + plane, b_l_s, mask=m_n)
    tl.store(o_stat + 2 * plane, b_best_s, mask=m_n)
    tl.store(arg_ptr + i_s.to(tl.int64) * N + o_n, b_arg_s.to(tl.int64), mask=m_n)
    if HAS_TEACHER:
        tl.store(o_stat + 3 * plane, b_m_t, mask=m_n)
        tl.store(o_stat + 4 * plane, b_l_t, mask=m_n)
        tl.store(o_stat + 5 * plane, b_a_ts, mask=m_n)
        tl.store(o_stat + 6 * plane, b_a_tt, mask=m_n)
        tl.store(o_stat + 7 * plane, b_best_t, mask=m_n)
        tl.store(arg_ptr + plane + i_s.to(tl.int64) * N + o_n, b_arg_t.to(tl.int64), mask=m_n)
    if HAS_REST:
        tl.store(o_stat + 8 * plane, b_m_r, mask=m_n)
        tl.store(o_stat + 9 * plane, b_l_r, mask=m_n)


@triton.jit
def _gather_logits_kernel(
    xd_ptr, w_ptr, ids_ptr, out_ptr, N, H, NUM_IDS, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """out[n, j] = xd[n] . W[ids[n, j]] in fp32; xd: [N, H], ids, out: [N, NUM_IDS]."""
    i_n, i_j = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_id = o_n.to(tl.int64) * NUM_IDS + i_j
    b_id = tl.load(ids_ptr + o_id, mask=m_n, other=0).to(tl.int64)
    b_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_x = m_n[:, None] & (o_k < H)[None, :]
        b_x = tl.load(xd_ptr + o_n.to(tl.int64)[:, None] * H + o_k[None, :], mask=m_x, other=0.0).to(tl.float32)
        b_w = tl.load(w_ptr + b_id[:, None] * stride_w + o_k[None, :], mask=m_x, other=0.0).to(tl.float32)
        b_acc += tl.sum(b_x * b_w, 1)
    tl.store(out_ptr + o_id, b_acc, mask=m_n)


@triton.autotune(configs=_LOGIT_TILES, key=["H", "HAS_TEACHER", "HAS_REST"])
@triton.jit
def _dlogits_kernel(
    xd_ptr,
    xt_ptr,
    w_ptr,
    ids_ptr,
    p_ptr,
    row_ptr,
    g_ptr,
    N,
    H,
    NUM_IDS,
    v_lo,
    v_hi,
    stride_w,
    stride_g,
    HAS_TEACHER: tl.constexpr,
    HAS_REST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """g[n, v - v_lo] = dl_n/ds_v = c q_v - p_v for v in [v_lo, v_hi), in g's dtype.

    row: [5, N] fp32 = lse(s), lse(t), c, p_rest, lse_rest; ids, p: [N, NUM_IDS] sparse
    target mass (stored top-k, or the label with mass 1); the dense teacher (HAS_TEACHER)
    adds softmax(t), the rest (HAS_REST) p_rest e^(s - lse_rest) off the ids.
    """
    i_n, i_v = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_v = v_lo + i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    m_v = o_v < v_hi
    b_s, b_t = _logit_tiles(
        xd_ptr, xt_ptr, w_ptr, o_n, m_n, o_v, m_v, H, stride_w, HAS_TEACHER, DOT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_K
    )
    b_lse_s = tl.load(row_ptr + o_n, mask=m_n, other=0.0)
    b_c = tl.load(row_ptr + 2 * N + o_n, mask=m_n, other=0.0)
    b_g = b_c[:, None] * tl.exp(b_s - b_lse_s[:, None])
    if HAS_TEACHER:
        b_lse_t = tl.load(row_ptr + N + o_n, mask=m_n, other=0.0)
        b_g -= tl.exp(b_t - b_lse_t[:, None])
    b_top = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.int1)
    for j in range(NUM_IDS):
        o_id = o_n.to(tl.int64) * NUM_IDS + j
        b_id = tl.load(ids_ptr + o_id, mask=m_n, other=-1)
        b_p = tl.load(p_ptr + o_id, mask=m_n, other=0.0)
        b_eq = o_v[None, :] == b_id[:, None]
        b_g -= tl.where(b_eq, b_p[:, None], 0.0)
        b_top = b_top | b_eq
    if HAS_REST:
        b_rest = tl.load(row_ptr + 3 * N + o_n, mask=m_n, other=0.0)
        b_lse_r = tl.load(row_ptr + 4 * N + o_n, mask=m_n, other=0.0)
        b_g -= tl.where(b_top, 0.0, b_rest[:, None] * tl.exp(b_s - b_lse_r[:, None]))
    o_g = o_n.to(tl.int64)[:, None] * stride_g + (o_v - v_lo)[None, :]
    tl.store(g_ptr + o_g, b_g.to(g_ptr.dtype.element_ty), mask=m_n[:, None] & m_v[None, :])


@triton.autotune(configs=_LOGIT_TILES, key=["H"])
@triton.jit
def _store_logits_kernel(
    xd_ptr,
    xt_ptr,
    w_ptr,
    s_ptr,
    t_ptr,
    N,
    V,
    H,
    stride_w,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """s = xd @ W^T and t = xt @ W^T as fp32 [N, V] for the N rows of one chunk; xd, xt: [N, H]; W: [V, H]."""
    i_n, i_v = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    m_n, m_v = o_n < N, o_v < V
    b_s, b_t = _logit_tiles(
        xd_ptr, xt_ptr, w_ptr, o_n, m_n, o_v, m_v, H, stride_w, True, DOT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_K
    )
    o_x = o_n.to(tl.int64)[:, None] * V + o_v[None, :]
    m_x = m_n[:, None] & m_v[None, :]
    tl.store(s_ptr + o_x, b_s, mask=m_x)
    tl.store(t_ptr + o_x, b_t, mask=m_x)


@triton.autotune(configs=_ROW_TILES, key=["V", "HARD"])
@triton.jit
def _stored_dlogits_kernel(
    s_ptr,
    t_ptr,
    g_ptr,
    stat_ptr,
    arg_ptr,
    N,
    V,
    stride_stat,
    HARD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Statistics and dl/ds of the N rows of one chunk from its stored logits s, t: [N, V] fp32.

    stat: [4, N] fp32 = lse(s), lse(t), sum_v p_v s_v, sum_v p_v t_v; arg: [2, N] int64 = first
    argmax of s, of t (both with plane stride stride_stat); g: [N, V] = q - p in g's dtype,
    q = softmax(s), p = softmax(t), or with HARD the one-hot of argmax(t).
    """
    i_n = tl.program_id(0)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_row = o_n.to(tl.int64)[:, None] * V
    b_m_s = tl.full([BLOCK_N], float("-inf"), tl.float32)
    b_l_s = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_best_s, b_arg_s = b_m_s, tl.zeros([BLOCK_N], dtype=tl.int32)
    b_m_t, b_l_t, b_best_t, b_arg_t = b_m_s, b_l_s, b_best_s, b_arg_s
    b_a_ts, b_a_tt = b_l_s, b_l_s
    for v0 in range(0, V, BLOCK_V):
        o_v = v0 + tl.arange(0, BLOCK_V)
        m_v = o_v < V
        m_x = m_n[:, None] & m_v[None, :]
        b_s = tl.load(s_ptr + o_row + o_v[None, :], mask=m_x, other=0.0)
        b_t = tl.load(t_ptr + o_row + o_v[None, :], mask=m_x, other=0.0)
        b_s_in = tl.where(m_v[None, :], b_s, float("-inf"))
        b_t_in = tl.where(m_v[None, :], b_t, float("-inf"))  # padded rows read 0: finite, never stored
        b_m_s, b_l_s = _online_lse(b_m_s, b_l_s, b_s_in)
        b_best_s, b_arg_s = _online_argmax(b_best_s, b_arg_s, b_s_in, v0)
        b_m_t, b_l_t, b_a_ts, b_a_tt = _online_teacher(b_m_t, b_l_t, b_a_ts, b_a_tt, b_t_in, b_s, b_t)
        b_best_t, b_arg_t = _online_argmax(b_best_t, b_arg_t, b_t_in, v0)
    b_lse_s = b_m_s + tl.log(b_l_s)
    b_lse_t = b_m_t + tl.log(b_l_t)
    tl.store(stat_ptr + o_n, b_lse_s, mask=m_n)
    tl.store(stat_ptr + stride_stat + o_n, b_lse_t, mask=m_n)
    tl.store(stat_ptr + 2 * stride_stat + o_n, b_a_ts / b_l_t, mask=m_n)
    tl.store(stat_ptr + 3 * stride_stat + o_n, b_a_tt / b_l_t, mask=m_n)
    tl.store(arg_ptr + o_n, b_arg_s.to(tl.int64), mask=m_n)
    tl.store(arg_ptr + stride_stat + o_n, b_arg_t.to(tl.int64), mask=m_n)
    # The target is known only after the first sweep; q - p is formed in fp32, then rounded.
    for v0 in range(0, V, BLOCK_V):
        o_v = v0 + tl.arange(0, BLOCK_V)
        m_x = m_n[:, None] & (o_v < V)[None, :]
        b_g = tl.exp(tl.load(s_ptr + o_row + o_v[None, :], mask=m_x, other=0.0) - b_lse_s[:, None])
        if HARD:
            b_g -= tl.where(o_v[None, :] == b_arg_t[:, None], 1.0, 0.0)
        else:
            b_g -= tl.exp(tl.load(t_ptr + o_row + o_v[None, :], mask=m_x, other=0.0) - b_lse_t[:, None])
        tl.store(g_ptr + o_row + o_v[None, :], b_g.to(g_ptr.dtype.element_ty), mask=m_x)


@triton.autotune(configs=_MATMUL_TILES, key=["NC", "ACCUMULATE", "HAS_SCALE"], restore_value=["c_ptr"])
@triton.jit
def _matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    scale_ptr,
    M,
    NC,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_cm,
    ACCUMULATE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_NC: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """c[M, NC] (+)= a[M, K] @ (scale[K, None] * b[K, NC]), fp32 accumulation; b and c have unit column stride."""
    i_m, i_c = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_c = i_c * BLOCK_NC + tl.arange(0, BLOCK_NC)
    m_m = o_m < M
    m_c = o_c < NC
    b_acc = tl.zeros([BLOCK_M, BLOCK_NC], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
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
        b_acc = tl.dot(b_a, b_b, b_acc, input_precision=DOT_PRECISION)
    o_out = c_ptr + o_m.to(tl.int64)[:, None] * stride_cm + o_c[None, :]
    m_out = m_m[:, None] & m_c[None, :]
    if ACCUMULATE:
        b_acc += tl.load(o_out, mask=m_out, other=0.0).to(tl.float32)
    tl.store(o_out, b_acc.to(c_ptr.dtype.element_ty), mask=m_out)


def _vocab_splits(n: int, v: int, device: torch.device) -> int:
    """Vocab splits per row tile: enough programs to fill the GPU twice over (assuming 128-row tiles)."""
    if not ON_GPU:
        return min(2, triton.cdiv(v, 128))
    return max(1, min(triton.cdiv(2 * sm_count(device), triton.cdiv(n, 128)), triton.cdiv(v, 2048)))


def _rescale(m: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-split running maxima [S, N] -> (common max [N], e^(m - max) [S, N]); max 0 where all are -inf."""
    top = m.max(0).values
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    return top, torch.exp(m - top)


def _merge_lse(m: torch.Tensor, sum_exp: torch.Tensor) -> torch.Tensor:
    """Per-split running max and sum [S, N] -> log-sum-exp [N] (-inf when every column was excluded)."""
    top, alpha = _rescale(m)
    return top + torch.log((sum_exp * alpha).sum(0))


def _merge_argmax(best: torch.Tensor, arg: torch.Tensor, v: int) -> torch.Tensor:
    """Per-split max and first index [S, N] -> first index of the overall max [N] (torch.argmax ties)."""
    top = best.max(0, keepdim=True).values
    return torch.where(best == top, arg, torch.full_like(arg, v)).min(0).values


def vocab_stats(
    xd: torch.Tensor, xt: Optional[torch.Tensor], weight: torch.Tensor, rest_ids: Optional[torch.Tensor]
) -> dict:
    """Pass 1 over the vocabulary. xd, xt: [N, H]; weight: [V, H]; rest_ids: [N, k] int64 or None.

    Returns [N] tensors: lse_s, draft_argmax; with xt: lse_t, sum_ps = sum_v p_v s_v,
    sum_pt = sum_v p_v t_v, teacher_argmax; with rest_ids: lse_rest over the other ids.
    """
    n, hid = xd.shape
    v = weight.shape[0]
    splits = _vocab_splits(n, v, xd.device)
    v_per_split = triton.cdiv(v, splits)
    stats = torch.empty(_STAT_FIELDS, splits, n, dtype=torch.float32, device=xd.device)
    arg = torch.empty(2, splits, n, dtype=torch.int64, device=xd.device)
    has_teacher, has_rest = xt is not None, rest_ids is not None
    _vocab_stats_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), splits)](
        xd,
        xt if has_teacher else xd,
        weight,
        rest_ids if has_rest else arg,
        stats,
        arg,
        n,
        v,
        hid,
        rest_ids.shape[1] if has_rest else 0,
        v_per_split,
        weight.stride(0),
        HAS_TEACHER=has_teacher,
        HAS_REST=has_rest,
        DOT_PRECISION=dot_precision(xd.dtype),
    )
    out = {"lse_s": _merge_lse(stats[0], stats[1]), "draft_argmax": _merge_argmax(stats[2], arg[0], v)}
    if has_teacher:
        m_t, alpha = _rescale(stats[3])
        l_t = (stats[4] * alpha).sum(0)
        out["lse_t"] = m_t + torch.log(l_t)
        out["sum_ps"] = (stats[5] * alpha).sum(0) / l_t
        out["sum_pt"] = (stats[6] * alpha).sum(0) / l_t
        out["teacher_argmax"] = _merge_argmax(stats[7], arg[1], v)
    if has_rest:
        out["lse_rest"] = _merge_lse(stats[8], stats[9])
    return out


def gather_logits(xd: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """s[n, j] = xd[n] . weight[ids[n, j]] in fp32. xd: [N, H]; weight: [V, H]; ids: [N, k] int64 -> [N, k]."""
    n, hid = xd.shape
    out = torch.empty(ids.shape, dtype=torch.float32, device=xd.device)
    block_n = 64 if not ON_GPU else 16
    block_k = min(triton.next_power_of_2(hid), 64 if not ON_GPU else 256)
    _gather_logits_kernel[(triton.cdiv(n, block_n), ids.shape[1])](
        xd, weight, ids, out, n, hid, ids.shape[1], weight.stride(0), BLOCK_N=block_n, BLOCK_K=block_k
    )
    return out


def _matmul(
    a: torch.Tensor,
    a_strides: Tuple[int, int],
    b: torch.Tensor,
    c: torch.Tensor,
    accumulate: bool,
    scale: Optional[torch.Tensor] = None,
) -> None:
    """c[M, NC] (+)= a[M, K] @ (scale[:, None] * b[K, NC]); a given by its (row, column) strides."""
    m, nc = c.shape
    k = b.shape[0]
    _matmul_kernel[lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(nc, meta["BLOCK_NC"]))](
        a,
        b,
        c,
        scale if scale is not None else c,
        m,
        nc,
        k,
        a_strides[0],
        a_strides[1],
        b.stride(0),
        c.stride(0),
        ACCUMULATE=accumulate,
        HAS_SCALE=scale is not None,
        DOT_PRECISION=dot_precision(a.dtype),
    )


def dlogits_backprop(
    xd: torch.Tensor,
    xt: Optional[torch.Tensor],
    weight: torch.Tensor,
    ids: torch.Tensor,
    p: torch.Tensor,
    rows: torch.Tensor,
    has_rest: bool,
    row_scale: torch.Tensor,
    need_dx: bool,
    need_dw: bool,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Pass 3: dxd_unit = dlogits @ W [N, H] fp32 and dW = dlogits^T @ (row_scale * xd) [V, H], chunk by chunk.

    xd, xt: [N, H]; weight: [V, H]; ids, p: [N, k] sparse target; rows: [5, N] (see
    `_dlogits_kernel`); row_scale: [N] = weights / denom. dxd_unit still lacks row_scale.
    """
    n, hid = xd.shape
    v = weight.shape[0]
    chunk = min(VOCAB_CHUNK, v)
    dlogits = torch.empty(n, chunk, dtype=xd.dtype, device=xd.device)
    dxd = torch.empty(n, hid, dtype=torch.float32, device=xd.device) if need_dx else None
    dw = torch.empty_like(weight) if need_dw else None
    for v_lo in range(0, v, chunk):
        v_hi = min(v_lo + chunk, v)
        width = v_hi - v_lo
        _dlogits_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(width, meta["BLOCK_V"]))](
            xd,
            xt if xt is not None else xd,
            weight,
            ids,
            p,
            rows,
            dlogits,
            n,
            hid,
            ids.shape[1],
            v_lo,
            v_hi,
            weight.stride(0),
            dlogits.stride(0),
            HAS_TEACHER=xt is not None,
            HAS_REST=has_rest,
            DOT_PRECISION=dot_precision(xd.dtype),
        )
        if need_dx:
            _matmul(dlogits, (dlogits.stride(0), 1), weight[v_lo:v_hi], dxd, accumulate=v_lo > 0)
        if need_dw:
            _matmul(dlogits, (1, dlogits.stride(0)), xd, dw[v_lo:v_hi], accumulate=False, scale=row_scale)
    return dxd, dw


def _store_rows(v: int, element_size: int) -> int:
    """Rows per chunk of the store strategy: s, t (fp32) and dlogits [C, V] within STORE_CHUNK_BYTES."""
    align = 128 if ON_GPU else 16
    return max(align, STORE_CHUNK_BYTES // (v * (8 + element_size)) // align * align)


def stored_logits_backprop(
    xd: torch.Tensor,
    xt: torch.Tensor,
    weight: torch.Tensor,
    hard: bool,
    row_scale: torch.Tensor,
    need_dx: bool,
    need_dw: bool,
) -> Tuple[dict, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The store strategy: pass 1 and pass 3 in one sweep over chunks of rows, 3 GEMMs instead of 5.

    xd, xt: [N, H]; weight: [V, H]; hard: the target is argmax(t) (ce), else softmax(t) (kl);
    row_scale: [N] = weights / denom. Returns the teacher fields of `vocab_stats` (lse_s,
    draft_argmax, lse_t, sum_ps, sum_pt, teacher_argmax; [N] each), dxd_unit [N, H] fp32
    (without row_scale, as `dlogits_backprop`) and dW [V, H] in weight's dtype.
    """
    n, hid = xd.shape
    v = weight.shape[0]
    rows = min(_store_rows(v, xd.element_size()), n)
    logits = torch.empty(2, rows, v, dtype=torch.float32, device=xd.device)
    dlogits = torch.empty(rows, v, dtype=xd.dtype, device=xd.device)
    stats = torch.empty(4, n, dtype=torch.float32, device=xd.device)
    arg = torch.empty(2, n, dtype=torch.int64, device=xd.device)
    dxd = torch.empty(n, hid, dtype=torch.float32, device=xd.device) if need_dx else None
    dw = torch.empty(v, hid, dtype=torch.float32, device=xd.device) if need_dw else None
    for lo in range(0, n, rows):
        hi = min(lo + rows, n)
        s, t, g = logits[0, : hi - lo], logits[1, : hi - lo], dlogits[: hi - lo]
        _store_logits_kernel[lambda meta: (triton.cdiv(hi - lo, meta["BLOCK_N"]), triton.cdiv(v, meta["BLOCK_V"]))](
            xd[lo:hi],
            xt[lo:hi],
            weight,
            s,
            t,
            hi - lo,
            v,
            hid,
            weight.stride(0),
            DOT_PRECISION=dot_precision(xd.dtype),
        )
        _stored_dlogits_kernel[lambda meta: (triton.cdiv(hi - lo, meta["BLOCK_N"]),)](
            s,
            t,
            g,
            stats[:, lo:hi],
            arg[:, lo:hi],
            hi - lo,
            v,
            n,
            HARD=hard,
        )
        if need_dx:
            _matmul(g, (v, 1), weight, dxd[lo:hi], accumulate=False)
        if need_dw:
            _matmul(g, (1, v), xd[lo:hi], dw, accumulate=lo > 0, scale=row_scale[lo:hi])
    st = dict(
        lse_s=stats[0], lse_t=stats[1], sum_ps=stats[2], sum_pt=stats[3], draft_argmax=arg[0], teacher_argmax=arg[1]
    )
    return st, dxd, None if dw is None else dw.to(weight.dtype)


def resolve_strategy(strategy: Optional[str]) -> str:
    """The gradient strategy of a call: the argument, else DFLASH_LM_HEAD_STRATEGY, else "recompute"."""
    source = "the strategy argument"
    if strategy is None:
        source, strategy = "DFLASH_LM_HEAD_STRATEGY", os.environ.get("DFLASH_LM_HEAD_STRATEGY") or "recompute"
    if strategy not in STRATEGIES:
        raise ValueError(f"lm_head_loss gradient strategy {strategy!r} (from {source}) is not one of {STRATEGIES}")
    return strategy


def _check_inputs(
    h, norm_weight, lm_head_weight, weights, kind, last, final_norm_weight, labels, topk_ids, topk_logits, topk_lse
):
    n, hid = h.shape if h.dim() == 2 else (None, None)
    if kind not in LOSS_KINDS:
        raise ValueError(f"loss kind {kind!r} is not one of {LOSS_KINDS}")
    if h.dim() != 2 or lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hid:
        raise ValueError(
            f"h must be [N, H] and lm_head_weight [V, H]; got {tuple(h.shape)} and {tuple(lm_head_weight.shape)}"
        )
    if h.dtype != lm_head_weight.dtype:
        raise ValueError(f"h is {h.dtype} but lm_head_weight is {lm_head_weight.dtype}: cast both to one dtype")
    if norm_weight.shape != (hid,) or weights.shape != (n,):
        raise ValueError(
            f"norm_weight must be [H] = [{hid}] and weights [N] = [{n}]; got {tuple(norm_weight.shape)} "
            f"and {tuple(weights.shape)}"
        )
    if kind == "kl" or (kind == "ce" and labels is None):
        if last is None or final_norm_weight is None:
            raise ValueError(f"loss kind {kind!r} without stored labels needs last and final_norm_weight")
        if last.shape != h.shape or last.dtype != h.dtype:
            raise ValueError(f"last must match h ({tuple(h.shape)}, {h.dtype}); got {tuple(last.shape)}, {last.dtype}")
    elif kind in ("ce", "ce_data"):
        if labels is None:
            raise ValueError(f"loss kind {kind!r} needs labels")
        if labels.shape != (n,):
            raise ValueError(f"labels must be [N] = [{n}]; got {tuple(labels.shape)}")
    elif topk_ids is None or topk_logits is None or topk_lse is None:
        raise ValueError("loss kind 'kl_topk' needs topk_ids, topk_logits and topk_lse")
    elif topk_ids.dim() != 2 or topk_ids.shape[0] != n or topk_logits.shape != topk_ids.shape:
        raise ValueError(
            f"topk_ids and topk_logits must be [N, k] with N = {n}; got {tuple(topk_ids.shape)}, "
            f"{tuple(topk_logits.shape)}"
        )


def _loss_terms(kind, st, xd, weight, labels, rest_ids, topk_logits, topk_lse):
    """Per-row loss l [N], KL [N] or None, teacher_argmax [N] (the label the loss used), and the
    target that pass 3 subtracts: ids, p [N, k] sparse mass and rows [5, N] (see `_dlogits_kernel`)."""
    n, v = xd.shape[0], weight.shape[0]
    lse_s = st["lse_s"]
    zeros = torch.zeros_like(lse_s)
    c, lse_t, p_rest, lse_rest = torch.ones_like(lse_s), zeros, zeros, zeros
    kl_row = None
    if kind == "kl":
        teacher_argmax, lse_t = st["teacher_argmax"], st["lse_t"]
        per_row = lse_s - st["sum_ps"]
        kl_row = st["sum_pt"] - lse_t - st["sum_ps"] + lse_s
        ids = torch.zeros(n, 0, dtype=torch.int64, device=xd.device)
        p = torch.zeros(n, 0, dtype=torch.float32, device=xd.device)
    elif kind in ("ce", "ce_data"):
        teacher_argmax = labels.long() if labels is not None else st["teacher_argmax"]
        ids = teacher_argmax.clamp(0, v - 1)[:, None].contiguous()
        p = torch.ones(n, 1, dtype=torch.float32, device=xd.device)
        per_row = lse_s - gather_logits(xd, weight, ids)[:, 0]
    else:
        ids = rest_ids
        teacher_argmax = ids[:, 0]
        p = torch.exp(topk_logits.float() - topk_lse.float()[:, None]).contiguous()
        p_rest = (1 - p.sum(-1)).clamp(min=0)
        logq_top = gather_logits(xd, weight, ids) - lse_s[:, None]
        rest_term = torch.where(p_rest > 0, p_rest * (st["lse_rest"] - lse_s), zeros)
        per_row = -((p * logq_top).sum(-1) + rest_term)
        plogp = torch.where(p > 0, p * p.clamp(min=1e-38).log(), torch.zeros_like(p)).sum(-1)
        plogp = plogp + torch.where(p_rest > 0, p_rest * p_rest.clamp(min=1e-38).log(), zeros)
        kl_row = plogp + per_row
        c = p.sum(-1) + p_rest
        rest_ok = (p_rest > 0) & torch.isfinite(st["lse_rest"])
        p_rest = torch.where(rest_ok, p_rest, zeros)
        # Rows without rest mass still evaluate p_rest * e^(s - lse_rest): any lse >= max s keeps it 0.
        lse_rest = torch.where(rest_ok, st["lse_rest"], lse_s)
    rows = torch.stack([lse_s, lse_t, c, p_rest, lse_rest]).contiguous()
    return per_row, kl_row, teacher_argmax, ids, p, rows


def lm_head_loss_forward(
    h: torch.Tensor,
    norm_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    weights: torch.Tensor,
    kind: str,
    normalizer: Union[float, torch.Tensor],
    eps: float,
    last: Optional[torch.Tensor] = None,
    final_norm_weight: Optional[torch.Tensor] = None,
    labels: Optional[torch.Tensor] = None,
    topk_ids: Optional[torch.Tensor] = None,
    topk_logits: Optional[torch.Tensor] = None,
    topk_lse: Optional[torch.Tensor] = None,
    strategy: Optional[str] = None,
    need_grads: Tuple[bool, bool, bool] = (False, False, False),
):
    """Loss, metrics and, for the inputs flagged in need_grads (h, norm_weight, lm_head_weight), d loss.

    Shapes and strategy as in `lm_head_loss`. Returns (loss [], kl [] or None, draft_argmax [N],
    teacher_argmax [N], grads): grads = (dh [N, H] or None, dnorm [H] or None, dW [V, H] or None).
    """
    _check_inputs(
        h, norm_weight, lm_head_weight, weights, kind, last, final_norm_weight, labels, topk_ids, topk_logits, topk_lse
    )
    strategy = resolve_strategy(strategy)
    h, weight = h.contiguous(), lm_head_weight if lm_head_weight.stride(1) == 1 else lm_head_weight.contiguous()
    xd, rstd = rms_norm_forward(h, norm_weight, eps)
    teacher = kind == "kl" or (kind == "ce" and labels is None)
    xt = rms_norm_forward(last.contiguous(), final_norm_weight, eps)[0] if teacher else None
    rest_ids = topk_ids.long().contiguous() if kind == "kl_topk" else None
    w = weights.float()
    denom = torch.as_tensor(normalizer, dtype=torch.float32, device=h.device).clamp(min=1)
    row_scale = (w / denom).contiguous()
    need_dx = need_grads[0] or need_grads[1]
    store = strategy == "store" and teacher and any(need_grads)
    if store:
        st, dxd, dw = stored_logits_backprop(xd, xt, weight, kind == "ce", row_scale, need_dx, need_grads[2])
    else:
        st = vocab_stats(xd, xt, weight, rest_ids)
    per_row, kl_row, teacher_argmax, ids, p, rows = _loss_terms(
        kind, st, xd, weight, labels, rest_ids, topk_logits, topk_lse
    )
    loss = (per_row * w).sum() / denom
    kl = None if kl_row is None else (kl_row * w).sum() / denom
    grads = (None, None, None)
    if any(need_grads):
        if not store:
            dxd, dw = dlogits_backprop(
                xd,
                xt if kind == "kl" else None,
                weight,
                ids,
                p,
                rows,
                kind == "kl_topk",
                row_scale,
                need_dx,
                need_grads[2],
            )
        dh, dnorm = rms_norm_backward(h, norm_weight, rstd, dxd, row_scale) if need_dx else (None, None)
        grads = (dh if need_grads[0] else None, dnorm if need_grads[1] else None, dw)
    return loss, kl, st["draft_argmax"], teacher_argmax, grads


def lm_head_loss_backward(grad_loss: torch.Tensor, grads):
    """Scale the unit gradients from lm_head_loss_forward by d(outer)/d loss (a scalar)."""
    return tuple(None if g is None else g * grad_loss.to(g.dtype) for g in grads)


class LmHeadLossFunction(torch.autograd.Function):
    """The gradients come out of the forward (the loss is the final scalar); backward scales them."""

    @staticmethod
    def forward(ctx, *args):
        loss, kl, draft_argmax, teacher_argmax, grads = lm_head_loss_forward(
            *args, need_grads=tuple(ctx.needs_input_grad[:3])
        )
        ctx.grads = grads
        kl = kl if kl is not None else loss.new_zeros(())
        ctx.mark_non_differentiable(kl, draft_argmax, teacher_argmax)
        return loss, kl, draft_argmax, teacher_argmax

    @staticmethod
    def backward(ctx, grad_loss, *_):
        dh, dnorm, dw = lm_head_loss_backward(grad_loss, ctx.grads)
        return (dh, dnorm, dw) + (None,) * (len(ctx.needs_input_grad) - 3)


def lm_head_loss(
    h: torch.Tensor,
    norm_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    weights: torch.Tensor,
    kind: str,
    normalizer: Union[float, torch.Tensor],
    eps: float,
    last: Optional[torch.Tensor] = None,
    final_norm_weight: Optional[torch.Tensor] = None,
    labels: Optional[torch.Tensor] = None,
    topk_ids: Optional[torch.Tensor] = None,
    topk_logits: Optional[torch.Tensor] = None,
    topk_lse: Optional[torch.Tensor] = None,
    strategy: Optional[str] = None,
) -> LossOutput:
    """Drafter norm + lm_head + loss against the teacher (SPEC §5) without [N, V] logits.

    h: [N, H] drafter pre-norm states; norm_weight: [H]; lm_head_weight: [V, H] (gets a
    gradient only if it requires grad); weights: [N]; last: [N, H]; final_norm_weight: [H];
    labels: [N]; topk_ids, topk_logits: [N, k]; topk_lse: [N]. Semantics and kinds exactly
    as `dflash_fast.eager.lm_head_loss`; logits are accumulated in fp32.
    strategy: how the gradient of a full-teacher loss is computed, "recompute" or "store"
    (module docstring); None reads DFLASH_LM_HEAD_STRATEGY, default "recompute".
    """
    args = (
        h,
        norm_weight,
        lm_head_weight,
        weights,
        kind,
        normalizer,
        eps,
        last,
        final_norm_weight,
        labels,
        topk_ids,
        topk_logits,
        topk_lse,
        strategy,
    )
    if torch.is_grad_enabled() and (h.requires_grad or norm_weight.requires_grad or lm_head_weight.requires_grad):
        loss, kl, draft_argmax, teacher_argmax = LmHeadLossFunction.apply(*args)
    else:  # the autograd Function would still see requires_grad under no_grad and compute gradients
        loss, kl, draft_argmax, teacher_argmax, _ = lm_head_loss_forward(*args)
    return LossOutput(loss, kl if kind in ("kl", "kl_topk") else None, draft_argmax, teacher_argmax)
