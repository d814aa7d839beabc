"""Anchored block-sparse attention (spec.md §4): flash-style Triton forward and backward.

Math, per query row (anchor i, slot j), q head h and its kv head h // g (GQA, g = Hq / Hkv):

    visible keys   context keys lo_ij <= p < hi_i (from the anchor's document start, or the window edge,
                   up to the anchor, strictly before it) and the slots j' of block i (j' <= j when causal);
                   lo_ij = lo_i for every slot, or with a per-query window W (window_from "query")
                   lo_ij = max(lo_i, hi_i - W + 1 + j): slot j's window ends at its own position a_i + j
    s_jp           = scale * q_j . k_p on visible keys, kept in base 2 (times log2 e)
    out_j          = sum_p softmax(s_j)_p v_p,   lse_j = log2 sum_p 2^(s_jp log2 e)   (fp32)
    backward       P = 2^(s log2 e - lse), delta_j = dO_j . out_j, dS = P * (dO V^T - delta),
                   dQ = scale dS K,  dV = P^T dO,  dK = scale dS^T Q   (dK, dV summed over the g heads)

Invalid anchors give zero rows and lse = +inf, which makes P = 0 in every backward pass. Documents are
contiguous runs, so anchor i's context is one interval [lo_i, hi_i), computed on the host in O(A + T); a
per-query window only raises each row's lower end, in the kernels (`_row_lo`), so slot 0's interval holds
every slot's and the tile bounds below stay supersets.

Tiles. Rows are packed by anchor: a pack of BLOCK_P rows (16, or the next power of two >= B when B > 16)
holds BLOCK_P // B whole blocks, and an anchor tile holds BLOCK_M // BLOCK_P packs (B = 16: 8 anchors,
128 rows, no padding). The own-block scores of a pack are one [BLOCK_P, BLOCK_P] block, so the own
blocks of a tile are one batched dot and no score between packs is ever computed. Context keys stream
in tiles of BLOCK_N from the smallest lo of the tile's valid anchors to the largest hi: tiles inside
[largest lo, smallest hi) are seen whole by every valid row and run in a loop without any mask; the
others (the ends of the range) run in a second loop with it. Key-tile addresses depend only on the
loop counter (no branch between sources), so the compiler pipelines the loads (cp.async).

Passes, with their MMAs and FLOPs per visited (query row, key) pair and channel of one q head:
  1. forward        (q head, anchor tile): own blocks, then the context tiles             2 MMAs, 4 FLOPs
  2. block pass     (anchor tile, kv head): for each q head of the group delta = rowsum(dO * out),
                    and dK, dV of the block keys (P, dP, dS recomputed per pack)         4 MMAs, 8 FLOPs
  3. dQ             (q head, anchor tile): the forward's context tiles, then own blocks   3 MMAs, 6 FLOPs
  4. context dK/dV  (kv head, context key tile): the g heads x anchor tiles of the anchors that may
                    see the key tile ([first, last) of `context_ranges`, contiguous for sorted anchors),
                    masked only where an anchor of the tile sees the key tile in part     4 MMAs, 8 FLOPs
  Forward 4, backward 14 FLOPs per pair and channel: dQ is not accumulated with atomics, so passes 3
  and 4 each recompute P and dP. Pass 4 keeps K, V in shared memory and accumulates dK^T = dS^T Q and
  dV^T = dO^T P transposed ([D, BLOCK_N]), so that both operands of every MMA come from shared memory
  (P and dS are staged there) and no transposed copy of them is held in registers.
  Launch order: heads vary fastest, then the heaviest tiles first (the last anchor tiles in passes 1
  and 3, which see the most context; in pass 4 the first key tiles of a document, which the most
  anchors see), so the g heads that read the same K/V tiles run together and the tail is short.

Memory. The forward reads q, k_blk, v_blk once per q head and each context key tile once per anchor
tile that visits it (the g heads of a kv head read the same tiles: mostly L2 hits); the backward reads
q, dO, out once more (block pass), q, dO and the key tiles again (dQ), and q, dO, lse, delta of every
anchor tile per context key tile (dK/dV). Each output is written once. Extra memory: the per-anchor
bounds [R, A] and their running max / suffix min, the per-position anchor ranges [R, T] of pass 4, and
lse, delta [R, Hq, A*B] fp32. Offsets inside one row of a tensor are int32 (the host checks the row
size; int64 offset tensors cost registers the dK/dV pass does not have).

Sorted anchors make the intervals monotone, which keeps a tile's context range tight and makes the
anchors that see one context tile a contiguous range; the code stays correct (only slower) for
unsorted valid anchors.
"""

import math
from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl
from dflash_fast.kernels._common import autotune_configs, check_device, dot_precision

from dflash_fast.drafter.masks import check_window, document_starts


def _configs(gpu_configs, interpreter_config):
    return autotune_configs(("BLOCK_M", "BLOCK_N"), gpu_configs, interpreter_config)


# (BLOCK_M, BLOCK_N, num_warps, num_stages). Query-tile kernels (forward, dQ): BLOCK_M query rows stay
# resident, BLOCK_N context keys stream past.
_Q_TILE_CONFIGS = _configs([(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3)], (32, 32, 4, 1))
# Context dK/dV: BLOCK_N keys stay resident, BLOCK_M query rows stream past.
_KEY_TILE_CONFIGS = _configs([(128, 64, 8, 2)], (32, 32, 4, 1))
# The block pass has no loop over keys: one fixed tile, and its loop over the g heads of a kv head is not
# software-pipelined (with stages > 1, Triton 3.6 spills its batched dots for every tile size).
_BLOCK_PASS_ROWS, _BLOCK_PASS_WARPS, _BLOCK_PASS_STAGES = 32, 4, 1


# ---------------------------------------------------------------- Triton kernels


@triton.jit
def _packed_rows(o_pack, o_local, anchor_start, n_anchor, BLOCK_SIZE: tl.constexpr, BLOCK_P: tl.constexpr):
    """Row (pack, row in pack) of the anchor tile starting at anchor_start -> o_anchor, o_q (its query
    index, anchor * B + slot) and m_q (real query rows: a whole block of the pack, anchor < A)."""
    n_pack = BLOCK_P // BLOCK_SIZE
    o_anchor = anchor_start + o_pack * n_pack + o_local // BLOCK_SIZE
    o_q = (anchor_start + o_pack * n_pack) * BLOCK_SIZE + o_local
    return o_anchor, o_q, (o_local < n_pack * BLOCK_SIZE) & (o_anchor < n_anchor)


@triton.jit
def _tile_rows(anchor_start, n_anchor, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr):
    """The rows of an anchor tile as [BLOCK_M] vectors: o_anchor, o_q, m_q."""
    o_m = tl.arange(0, BLOCK_M)
    return _packed_rows(o_m // BLOCK_P, o_m % BLOCK_P, anchor_start, n_anchor, BLOCK_SIZE, BLOCK_P)


@triton.jit
def _tile_packs(anchor_start, n_anchor, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr):
    """The same rows as [BLOCK_M // BLOCK_P, BLOCK_P] (pack, row in pack): o_q, m_q."""
    o_pack = tl.arange(0, BLOCK_M // BLOCK_P)[:, None]
    o_local = tl.arange(0, BLOCK_P)[None, :]
    _, o_q, m_q = _packed_rows(o_pack, o_local, anchor_start, n_anchor, BLOCK_SIZE, BLOCK_P)
    return o_q, m_q


@triton.jit
def _load_packs(base_ptr, stride, o_q, m_q, HEAD_DIM: tl.constexpr):
    """[packs, BLOCK_P, HEAD_DIM] rows o_q of one head (row stride `stride`), zero where not m_q."""
    o_d = tl.arange(0, HEAD_DIM)
    return tl.load(base_ptr + o_q[:, :, None] * stride + o_d[None, None, :], mask=m_q[:, :, None], other=0.0)


@triton.jit
def _pack_visible(BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_P: tl.constexpr, KEYS_FIRST: tl.constexpr):
    """[1, BLOCK_P, BLOCK_P] own-block visibility inside a pack: same block and a real key row (and key slot
    <= query slot when causal); queries on axis 1 and keys on axis 2, or the transpose with KEYS_FIRST."""
    o_local = tl.arange(0, BLOCK_P)
    if KEYS_FIRST:
        o_key, o_query = o_local[:, None], o_local[None, :]
    else:
        o_query, o_key = o_local[:, None], o_local[None, :]
    m_vis = (o_key // BLOCK_SIZE == o_query // BLOCK_SIZE) & (o_key < (BLOCK_P // BLOCK_SIZE) * BLOCK_SIZE)
    if CAUSAL:
        m_vis = m_vis & (o_key <= o_query)
    # A padding row sees itself (a zero key), which keeps its softmax finite; a real row sees itself anyway.
    return (m_vis | (o_key == o_query))[None, :, :]


@triton.jit
def _context_tiles(b_lo, b_hi, m_valid, n_ctx, BLOCK_N: tl.constexpr):
    """The context key tiles of an anchor tile (rows' bounds b_lo, b_hi; m_valid: rows of valid anchors),
    laid from ctx_start = the smallest lo: n_lead tiles reaching into [min lo, max lo) (masked), n_full
    tiles inside [max lo, min hi) (seen whole by every valid row), n_tail tiles up to the largest hi
    (masked). All counts are zero without a valid row."""
    ctx_start = tl.min(tl.where(m_valid, b_lo, n_ctx), axis=0)
    lo_max = tl.max(tl.where(m_valid, b_lo, 0), axis=0)
    hi_min = tl.min(tl.where(m_valid, b_hi, n_ctx), axis=0)
    hi_max = tl.max(tl.where(m_valid, b_hi, 0), axis=0)
    n_all = tl.cdiv(tl.maximum(hi_max - ctx_start, 0), BLOCK_N)
    n_lead = tl.minimum(tl.cdiv(tl.maximum(lo_max - ctx_start, 0), BLOCK_N), n_all)
    n_full = tl.minimum(tl.maximum(hi_min - (ctx_start + n_lead * BLOCK_N), 0) // BLOCK_N, n_all - n_lead)
    return ctx_start, n_lead, n_full, n_all - n_lead - n_full


@triton.jit
def _row_lo(b_lo, b_hi, o_q, query_window, BLOCK_SIZE: tl.constexpr):
    """The first context key row o_q sees: its anchor's lo, or with a per-query window W (query_window > 0)
    the larger of that and the window edge of its slot's own position, hi - W + 1 + slot (hi is the anchor)."""
    return tl.where(query_window > 0, tl.maximum(b_lo, b_hi - query_window + 1 + o_q % BLOCK_SIZE), b_lo)


@triton.jit
def _anchor_bounds(lo_ptr, hi_ptr, valid_ptr, query_window, o_anchor, o_q, m_q, BLOCK_SIZE: tl.constexpr):
    """Per row of a tile (o_anchor, o_q, m_q from `_tile_rows`; pointers at the batch row): m_valid (a valid
    anchor) and the row's context interval [b_lo, b_hi)."""
    m_valid = tl.load(valid_ptr + o_anchor, mask=m_q, other=0) != 0
    b_lo = tl.load(lo_ptr + o_anchor, mask=m_q, other=0)
    b_hi = tl.load(hi_ptr + o_anchor, mask=m_q, other=0)
    return m_valid, _row_lo(b_lo, b_hi, o_q, query_window, BLOCK_SIZE), b_hi


@triton.jit
def _context_scores(
    b_q, k_base_ptr, v_base_ptr, stride_k,  # queries [BLOCK_M, D]; context K, V of one row and kv head
    key_start, b_lo, b_hi, n_ctx, qk_scale,  # the key tile, each row's [lo, hi), T, scale * log2 e
    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Context keys [key_start, key_start + BLOCK_N) -> k, v [BLOCK_N, D] and the base-2 scores of b_q
    [BLOCK_M, BLOCK_N]; MASKED: -inf outside each row's [lo, hi), and keys past n_ctx load as zero."""
    o_n = key_start + tl.arange(0, BLOCK_N)
    o_kv = o_n[:, None] * stride_k + tl.arange(0, HEAD_DIM)[None, :]
    if MASKED:
        m_key = (o_n < n_ctx)[:, None]
        b_k = tl.load(k_base_ptr + o_kv, mask=m_key, other=0.0)
        b_v = tl.load(v_base_ptr + o_kv, mask=m_key, other=0.0)
    else:
        b_k = tl.load(k_base_ptr + o_kv)
        b_v = tl.load(v_base_ptr + o_kv)
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        b_s = tl.where((o_n[None, :] >= b_lo[:, None]) & (o_n[None, :] < b_hi[:, None]), b_s, float("-inf"))
    return b_k, b_v, b_s


@triton.jit
def _context_tile_start(it, ctx_start, n_lead, n_full, MASKED: tl.constexpr, BLOCK_N: tl.constexpr):
    """First key of iteration it of a loop over the tiles of `_context_tiles`: the masked loop takes the
    n_lead leading tiles, then jumps over the n_full interior ones to the tail; the unmasked loop takes
    the interior ones. (The tile depends only on the loop counter: the loads stay pipelined.)"""
    if MASKED:
        i_tile = tl.where(it < n_lead, it, it + n_full)
    else:
        i_tile = n_lead + it
    return ctx_start + i_tile * BLOCK_N


@triton.jit
def _fwd_context_loop(
    b_acc, b_sum, b_max, b_q,  # online-softmax state: [BLOCK_M, D] fp32, row sums, row maxima; queries
    k_base_ptr, v_base_ptr, stride_k, b_lo, b_hi, n_ctx, qk_scale,  # as in `_context_scores`
    ctx_start, n_lead, n_full, n_iter,  # the tiles of `_context_tiles`, and this loop's trip count
    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Online-softmax steps over the context tiles of one loop (`_context_tile_start`). b_max is finite on
    entry (every row has seen its own pack), so a row that sees none of the keys of a tile keeps its state."""
    for it in range(n_iter):
        key_start = _context_tile_start(it, ctx_start, n_lead, n_full, MASKED, BLOCK_N)
        b_k, b_v, b_s = _context_scores(
            b_q, k_base_ptr, v_base_ptr, stride_k, key_start, b_lo, b_hi, n_ctx, qk_scale,
            MASKED, HEAD_DIM, BLOCK_N, DOT_PRECISION,
        )
        b_max_new = tl.maximum(b_max, tl.max(b_s, axis=1))
        b_p = tl.exp2(b_s - b_max_new[:, None])
        b_alpha = tl.exp2(b_max - b_max_new)
        b_sum = b_sum * b_alpha + tl.sum(b_p, axis=1)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)
        b_max = b_max_new
    return b_acc, b_sum, b_max


@triton.jit
def _dq_context_loop(
    b_dq, b_q, b_do, b_lse, b_delta,  # dQ (unscaled) [BLOCK_M, D] fp32; queries, dO, saved lse and delta
    k_base_ptr, v_base_ptr, stride_k, b_lo, b_hi, n_ctx, qk_scale,  # as in `_context_scores`
    ctx_start, n_lead, n_full, n_iter,  # as in `_fwd_context_loop`
    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dQ += dS K over the context tiles of one loop, P from the saved lse."""
    for it in range(n_iter):
        key_start = _context_tile_start(it, ctx_start, n_lead, n_full, MASKED, BLOCK_N)
        b_k, b_v, b_s = _context_scores(
            b_q, k_base_ptr, v_base_ptr, stride_k, key_start, b_lo, b_hi, n_ctx, qk_scale,
            MASKED, HEAD_DIM, BLOCK_N, DOT_PRECISION,
        )
        b_p = tl.exp2(b_s - b_lse[:, None])
        b_ds = b_p * (tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PRECISION) - b_delta[:, None])
        b_dq += tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=DOT_PRECISION)
    return b_dq


@triton.jit
def _tile_start(i_tile, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr):
    """First anchor of anchor tile i_tile."""
    return i_tile * (BLOCK_M // BLOCK_P) * (BLOCK_P // BLOCK_SIZE)


@triton.jit
def _q_tile_program(n_qh, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr):
    """The (row i_r, q head i_h, first anchor) of a forward or dQ program. Heads vary fastest and the last
    anchor tiles (late anchors see the most context) launch first: the heaviest programs start first, and
    the g heads that read the same K/V tiles run together."""
    i_rh, i_tile = tl.program_id(0), tl.num_programs(1) - 1 - tl.program_id(1)
    return (i_rh // n_qh).to(tl.int64), i_rh % n_qh, _tile_start(i_tile, BLOCK_SIZE, BLOCK_M, BLOCK_P)


@triton.jit
def _q_head_offsets(i_r, i_h, n_ctx, n_anchor, n_qh, group, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Row strides of q-shaped and k-shaped tensors, and where row i_r, q head i_h starts in q/dO/out
    (q_offset), in k_blk/v_blk and k_ctx/v_ctx (its kv head's), and in lse/delta (stat_offset)."""
    n_q = n_anchor * BLOCK_SIZE
    stride_q, stride_k = n_qh * HEAD_DIM, n_qh // group * HEAD_DIM
    q_offset = i_r * n_q * stride_q + i_h * HEAD_DIM
    blk_offset = i_r * n_q * stride_k + i_h // group * HEAD_DIM
    ctx_offset = i_r * n_ctx * stride_k + i_h // group * HEAD_DIM
    return stride_q, stride_k, q_offset, blk_offset, ctx_offset, (i_r * n_qh + i_h) * n_q


@triton.autotune(configs=_Q_TILE_CONFIGS, key=["n_ctx", "n_anchor", "BLOCK_SIZE", "HEAD_DIM", "CAUSAL"])
@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ctx_ptr, v_ctx_ptr, k_blk_ptr, v_blk_ptr,  # [R, A*B, Hq, D], [R, T, Hkv, D] x2, [R, A*B, Hkv, D] x2
    out_ptr, lse_ptr,  # [R, A*B, Hq, D], [R, Hq, A*B] fp32
    lo_ptr, hi_ptr, valid_ptr, query_window,  # [R, A] int32 x3 and an int: the VisibilityPlan
    n_ctx, n_anchor, n_qh, group, qk_scale,  # T, A, Hq, g = Hq / Hkv, scale * log2 e
    BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out and lse (base 2, +inf on invalid anchors) of one (row, q head, anchor tile): its own packs,
    then the context tiles of `_context_tiles`."""
    i_r, i_h, anchor_start = _q_tile_program(n_qh, BLOCK_SIZE, BLOCK_M, BLOCK_P)
    stride_q, stride_k, q_offset, blk_offset, ctx_offset, stat_offset = _q_head_offsets(
        i_r, i_h, n_ctx, n_anchor, n_qh, group, BLOCK_SIZE, HEAD_DIM
    )

    # Own blocks: one [BLOCK_P, BLOCK_P] softmax block per pack; they start the online softmax.
    o_q3, m_q3 = _tile_packs(anchor_start, n_anchor, BLOCK_SIZE, BLOCK_M, BLOCK_P)
    b_q3 = _load_packs(q_ptr + q_offset, stride_q, o_q3, m_q3, HEAD_DIM)
    b_k3 = _load_packs(k_blk_ptr + blk_offset, stride_k, o_q3, m_q3, HEAD_DIM)
    b_v3 = _load_packs(v_blk_ptr + blk_offset, stride_k, o_q3, m_q3, HEAD_DIM)
    b_s3 = tl.dot(b_q3, tl.trans(b_k3, 0, 2, 1), input_precision=DOT_PRECISION) * qk_scale
    b_s3 = tl.where(_pack_visible(BLOCK_SIZE, CAUSAL, BLOCK_P, False), b_s3, float("-inf"))
    b_max3 = tl.max(b_s3, axis=2)
    b_p3 = tl.exp2(b_s3 - b_max3[:, :, None])
    b_acc = tl.reshape(tl.dot(b_p3.to(b_v3.dtype), b_v3, input_precision=DOT_PRECISION), [BLOCK_M, HEAD_DIM])
    b_sum = tl.reshape(tl.sum(b_p3, axis=2), [BLOCK_M])
    b_max = tl.reshape(b_max3, [BLOCK_M])
    b_q = tl.reshape(b_q3, [BLOCK_M, HEAD_DIM])

    o_anchor, o_q, m_q = _tile_rows(anchor_start, n_anchor, BLOCK_SIZE, BLOCK_M, BLOCK_P)
    anchor_offset = i_r * n_anchor
    m_valid, b_lo, b_hi = _anchor_bounds(lo_ptr + anchor_offset, hi_ptr + anchor_offset, valid_ptr + anchor_offset,
                                         query_window, o_anchor, o_q, m_q, BLOCK_SIZE)
    ctx_start, n_lead, n_full, n_tail = _context_tiles(b_lo, b_hi, m_valid, n_ctx, BLOCK_N)
    k_ctx_ptr, v_ctx_ptr = k_ctx_ptr + ctx_offset, v_ctx_ptr + ctx_offset
    b_acc, b_sum, b_max = _fwd_context_loop(  # the edge tiles, masked
        b_acc, b_sum, b_max, b_q, k_ctx_ptr, v_ctx_ptr, stride_k, b_lo, b_hi, n_ctx, qk_scale,
        ctx_start, n_lead, n_full, n_lead + n_tail, True, HEAD_DIM, BLOCK_N, DOT_PRECISION,
    )
    b_acc, b_sum, b_max = _fwd_context_loop(  # the interior tiles, which every valid row sees whole
        b_acc, b_sum, b_max, b_q, k_ctx_ptr, v_ctx_ptr, stride_k, b_lo, b_hi, n_ctx, qk_scale,
        ctx_start, n_lead, n_full, n_full, False, HEAD_DIM, BLOCK_N, DOT_PRECISION,
    )

    b_out = tl.where(m_valid[:, None], b_acc / b_sum[:, None], 0.0)
    b_lse = tl.where(m_valid, b_max + tl.log2(b_sum), float("inf"))
    p_out = out_ptr + q_offset + o_q[:, None] * stride_q + tl.arange(0, HEAD_DIM)[None, :]
    tl.store(p_out, b_out.to(out_ptr.dtype.element_ty), mask=m_q[:, None])
    tl.store(lse_ptr + stat_offset + o_q, b_lse, mask=m_q)


@triton.jit
def _attn_bwd_block_kernel(
    q_ptr, k_blk_ptr, v_blk_ptr, out_ptr, do_ptr, lse_ptr,  # the forward's inputs and outputs, and dO
    delta_ptr, dk_blk_ptr, dv_blk_ptr,  # written: [R, Hq, A*B] fp32, [R, A*B, Hkv, D] x2
    n_anchor, n_qh, group, qk_scale, scale,  # A, Hq, g = Hq / Hkv, scale * log2 e, scale
    BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """The block pass of one (row, kv head, anchor tile): delta = rowsum(dO * out) of each of its g q heads
    (stored for the dQ and dK/dV passes), and dK, dV of the block keys, which only their own block sees."""
    i_tile, i_rh = tl.program_id(0), tl.program_id(1)
    n_kh = n_qh // group
    i_r, i_hk = (i_rh // n_kh).to(tl.int64), i_rh % n_kh
    n_q = n_anchor * BLOCK_SIZE
    stride_q, stride_k = n_qh * HEAD_DIM, n_kh * HEAD_DIM
    blk_offset = i_r * n_q * stride_k + i_hk * HEAD_DIM
    o_q3, m_q3 = _tile_packs(_tile_start(i_tile, BLOCK_SIZE, BLOCK_M, BLOCK_P), n_anchor, BLOCK_SIZE, BLOCK_M, BLOCK_P)
    b_k3 = _load_packs(k_blk_ptr + blk_offset, stride_k, o_q3, m_q3, HEAD_DIM)
    b_v3 = _load_packs(v_blk_ptr + blk_offset, stride_k, o_q3, m_q3, HEAD_DIM)
    m_vis = _pack_visible(BLOCK_SIZE, CAUSAL, BLOCK_P, True)

    b_dk3 = tl.zeros([BLOCK_M // BLOCK_P, BLOCK_P, HEAD_DIM], dtype=tl.float32)
    b_dv3 = tl.zeros([BLOCK_M // BLOCK_P, BLOCK_P, HEAD_DIM], dtype=tl.float32)
    for i_h in range(i_hk * group, (i_hk + 1) * group):
        q_offset = i_r * n_q * stride_q + i_h * HEAD_DIM
        b_q3 = _load_packs(q_ptr + q_offset, stride_q, o_q3, m_q3, HEAD_DIM)
        b_do3 = _load_packs(do_ptr + q_offset, stride_q, o_q3, m_q3, HEAD_DIM)
        b_out3 = _load_packs(out_ptr + q_offset, stride_q, o_q3, m_q3, HEAD_DIM)
        stat_offset = (i_r * n_qh + i_h) * n_q
        b_delta3 = tl.sum(b_out3.to(tl.float32) * b_do3.to(tl.float32), axis=2)
        tl.store(delta_ptr + stat_offset + o_q3, b_delta3, mask=m_q3)
        b_lse3 = tl.load(lse_ptr + stat_offset + o_q3, mask=m_q3, other=float("inf"))
        # Keys on axis 1, queries on axis 2: P^T of each pack.
        b_st3 = tl.dot(b_k3, tl.trans(b_q3, 0, 2, 1), input_precision=DOT_PRECISION) * qk_scale
        b_pt3 = tl.where(m_vis, tl.exp2(b_st3 - b_lse3[:, None, :]), 0.0)
        b_dv3 += tl.dot(b_pt3.to(b_do3.dtype), b_do3, input_precision=DOT_PRECISION)
        b_dpt3 = tl.dot(b_v3, tl.trans(b_do3, 0, 2, 1), input_precision=DOT_PRECISION)
        b_dst3 = b_pt3 * (b_dpt3 - b_delta3[:, None, :])
        b_dk3 += tl.dot(b_dst3.to(b_q3.dtype), b_q3, input_precision=DOT_PRECISION)
    o_dkv = o_q3[:, :, None] * stride_k + tl.arange(0, HEAD_DIM)[None, None, :]
    b_dk3 = (b_dk3 * scale).to(dk_blk_ptr.dtype.element_ty)
    tl.store(dk_blk_ptr + blk_offset + o_dkv, b_dk3, mask=m_q3[:, :, None])
    tl.store(dv_blk_ptr + blk_offset + o_dkv, b_dv3.to(dv_blk_ptr.dtype.element_ty), mask=m_q3[:, :, None])


@triton.autotune(configs=_Q_TILE_CONFIGS, key=["n_ctx", "n_anchor", "BLOCK_SIZE", "HEAD_DIM", "CAUSAL"])
@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr, k_ctx_ptr, v_ctx_ptr, k_blk_ptr, v_blk_ptr,  # as in the forward
    do_ptr, lse_ptr, delta_ptr, dq_ptr,  # dO, the saved lse and delta, and dQ (written, shaped as q)
    lo_ptr, hi_ptr, valid_ptr, query_window,  # [R, A] int32 x3 and an int: the VisibilityPlan
    n_ctx, n_anchor, n_qh, group, qk_scale, scale,  # T, A, Hq, g = Hq / Hkv, scale * log2 e, scale
    BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dQ = scale * dS K of one (row, q head, anchor tile) over the keys the forward visited: the same
    context tiles, then its own packs. Rows with lse = +inf (invalid anchors, padding) get P = 0, so dQ = 0."""
    i_r, i_h, anchor_start = _q_tile_program(n_qh, BLOCK_SIZE, BLOCK_M, BLOCK_P)
    stride_q, stride_k, q_offset, blk_offset, ctx_offset, stat_offset = _q_head_offsets(
        i_r, i_h, n_ctx, n_anchor, n_qh, group, BLOCK_SIZE, HEAD_DIM
    )

    o_anchor, o_q, m_q = _tile_rows(anchor_start, n_anchor, BLOCK_SIZE, BLOCK_M, BLOCK_P)
    anchor_offset = i_r * n_anchor
    m_valid, b_lo, b_hi = _anchor_bounds(lo_ptr + anchor_offset, hi_ptr + anchor_offset, valid_ptr + anchor_offset,
                                         query_window, o_anchor, o_q, m_q, BLOCK_SIZE)
    o_qd = o_q[:, None] * stride_q + tl.arange(0, HEAD_DIM)[None, :]
    b_q = tl.load(q_ptr + q_offset + o_qd, mask=m_q[:, None], other=0.0)
    b_do = tl.load(do_ptr + q_offset + o_qd, mask=m_q[:, None], other=0.0)
    b_lse = tl.load(lse_ptr + stat_offset + o_q, mask=m_q, other=float("inf"))
    b_delta = tl.load(delta_ptr + stat_offset + o_q, mask=m_q, other=0.0)
    b_dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    ctx_start, n_lead, n_full, n_tail = _context_tiles(b_lo, b_hi, m_valid, n_ctx, BLOCK_N)
    k_ctx_ptr, v_ctx_ptr = k_ctx_ptr + ctx_offset, v_ctx_ptr + ctx_offset
    b_dq = _dq_context_loop(  # the edge tiles, masked
        b_dq, b_q, b_do, b_lse, b_delta, k_ctx_ptr, v_ctx_ptr, stride_k, b_lo, b_hi, n_ctx, qk_scale,
        ctx_start, n_lead, n_full, n_lead + n_tail, True, HEAD_DIM, BLOCK_N, DOT_PRECISION,
    )
    b_dq = _dq_context_loop(  # the interior tiles
        b_dq, b_q, b_do, b_lse, b_delta, k_ctx_ptr, v_ctx_ptr, stride_k, b_lo, b_hi, n_ctx, qk_scale,
        ctx_start, n_lead, n_full, n_full, False, HEAD_DIM, BLOCK_N, DOT_PRECISION,
    )

    # Own blocks last: one [BLOCK_P, BLOCK_P] block per pack (a batched dot).
    o_q3, m_q3 = _tile_packs(anchor_start, n_anchor, BLOCK_SIZE, BLOCK_M, BLOCK_P)
    b_q3 = _load_packs(q_ptr + q_offset, stride_q, o_q3, m_q3, HEAD_DIM)
    b_do3 = _load_packs(do_ptr + q_offset, stride_q, o_q3, m_q3, HEAD_DIM)
    b_k3 = _load_packs(k_blk_ptr + blk_offset, stride_k, o_q3, m_q3, HEAD_DIM)
    b_v3 = _load_packs(v_blk_ptr + blk_offset, stride_k, o_q3, m_q3, HEAD_DIM)
    b_lse3 = tl.load(lse_ptr + stat_offset + o_q3, mask=m_q3, other=float("inf"))
    b_delta3 = tl.load(delta_ptr + stat_offset + o_q3, mask=m_q3, other=0.0)
    b_s3 = tl.dot(b_q3, tl.trans(b_k3, 0, 2, 1), input_precision=DOT_PRECISION) * qk_scale
    b_p3 = tl.where(_pack_visible(BLOCK_SIZE, CAUSAL, BLOCK_P, False), tl.exp2(b_s3 - b_lse3[:, :, None]), 0.0)
    b_ds3 = b_p3 * (tl.dot(b_do3, tl.trans(b_v3, 0, 2, 1), input_precision=DOT_PRECISION) - b_delta3[:, :, None])
    b_dq += tl.reshape(tl.dot(b_ds3.to(b_k3.dtype), b_k3, input_precision=DOT_PRECISION), [BLOCK_M, HEAD_DIM])
    p_dq = dq_ptr + q_offset + o_q[:, None] * stride_q + tl.arange(0, HEAD_DIM)[None, :]
    tl.store(p_dq, (b_dq * scale).to(dq_ptr.dtype.element_ty), mask=m_q[:, None])


@triton.autotune(configs=_KEY_TILE_CONFIGS, key=["n_ctx", "n_anchor", "BLOCK_SIZE", "HEAD_DIM"])
@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ctx_ptr, v_ctx_ptr, do_ptr, lse_ptr, delta_ptr,  # as in the dQ pass
    dk_ctx_ptr, dv_ctx_ptr,  # written, shaped as k_ctx
    lo_ptr, hi_ptr, query_window, first_ptr, last_ptr, lo_max_ptr, hi_min_ptr,  # the plan's but valid; ContextRanges
    n_ctx, n_anchor, n_qh, group, qk_scale, scale,  # as in the dQ pass
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dV = P^T dO, dK = scale * dS^T Q of one (row, context key tile, kv head), summed over its g q heads
    and the anchor tiles from first[key_start] to last[key_end - 1], the anchors that may see the key tile
    (both accumulated transposed, see the module docstring). One program owns its output tile: no atomics."""
    # kv head fastest, then the key tile, then the row.
    n_kh = n_qh // group
    i_p = tl.program_id(0)
    i_hk, key_start = i_p % n_kh, i_p // n_kh % tl.cdiv(n_ctx, BLOCK_N) * BLOCK_N
    i_r = (i_p // (n_kh * tl.cdiv(n_ctx, BLOCK_N))).to(tl.int64)
    n_q = n_anchor * BLOCK_SIZE
    stride_q, stride_k = n_qh * HEAD_DIM, n_kh * HEAD_DIM
    o_n = key_start + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, HEAD_DIM)
    m_key = (o_n < n_ctx)[:, None]
    ctx_offset = i_r * n_ctx * stride_k + i_hk * HEAD_DIM
    o_kv = o_n[:, None] * stride_k + o_d[None, :]
    # Transposed once, before the loop: the compiler then stores them to shared memory once (a transpose
    # inside the loop kept a register copy and stored it again every iteration).
    b_kt = tl.trans(tl.load(k_ctx_ptr + ctx_offset + o_kv, mask=m_key, other=0.0))
    b_vt = tl.trans(tl.load(v_ctx_ptr + ctx_offset + o_kv, mask=m_key, other=0.0))
    anchor_first = tl.load(first_ptr + i_r * n_ctx + key_start)
    anchor_last = tl.load(last_ptr + i_r * n_ctx + tl.minimum(key_start + BLOCK_N, n_ctx) - 1)
    tile_anchors = (BLOCK_M // BLOCK_P) * (BLOCK_P // BLOCK_SIZE)
    n_tiles = tl.cdiv(tl.maximum(anchor_last - anchor_first, 0), tile_anchors)
    anchor_offset = i_r * n_anchor

    b_dkt = tl.zeros([HEAD_DIM, BLOCK_N], dtype=tl.float32)
    b_dvt = tl.zeros([HEAD_DIM, BLOCK_N], dtype=tl.float32)
    for it in range(group * n_tiles):
        i_h = i_hk * group + it // n_tiles
        anchor_start = anchor_first + it % n_tiles * tile_anchors
        anchor_end = tl.minimum(anchor_start + tile_anchors, anchor_last)
        o_anchor, o_q, m_q = _tile_rows(anchor_start, anchor_last, BLOCK_SIZE, BLOCK_M, BLOCK_P)
        q_offset = i_r * n_q * stride_q + i_h * HEAD_DIM
        o_qd = o_q[:, None] * stride_q + o_d[None, :]
        b_q = tl.load(q_ptr + q_offset + o_qd, mask=m_q[:, None], other=0.0)
        b_do = tl.load(do_ptr + q_offset + o_qd, mask=m_q[:, None], other=0.0)
        stat_offset = (i_r * n_qh + i_h) * n_q
        b_lse = tl.load(lse_ptr + stat_offset + o_q, mask=m_q, other=float("inf"))
        b_delta = tl.load(delta_ptr + stat_offset + o_q, mask=m_q, other=0.0)
        # Queries on the rows: the per-query lse, delta, lo, hi are row vectors of the MMA layout.
        b_p = tl.exp2(tl.dot(b_q, b_kt, input_precision=DOT_PRECISION) * qk_scale - b_lse[:, None])
        # The mask unless every valid anchor of the tile sees the whole key tile: the running max of lo up
        # to the tile's last anchor and the suffix min of hi from its first bound the tile's own.
        lo_max = tl.load(lo_max_ptr + anchor_offset + anchor_end - 1)
        hi_min = tl.load(hi_min_ptr + anchor_offset + anchor_start)
        if (lo_max > key_start) | (hi_min < key_start + BLOCK_N):
            b_lo = tl.load(lo_ptr + anchor_offset + o_anchor, mask=m_q, other=0)
            b_hi = tl.load(hi_ptr + anchor_offset + o_anchor, mask=m_q, other=0)
            b_lo = _row_lo(b_lo, b_hi, o_q, query_window, BLOCK_SIZE)
            b_p = tl.where((o_n[None, :] >= b_lo[:, None]) & (o_n[None, :] < b_hi[:, None]), b_p, 0.0)
        b_dvt += tl.dot(tl.trans(b_do), b_p.to(b_do.dtype), input_precision=DOT_PRECISION)
        b_ds = b_p * (tl.dot(b_do, b_vt, input_precision=DOT_PRECISION) - b_delta[:, None])
        b_dkt += tl.dot(tl.trans(b_q), b_ds.to(b_q.dtype), input_precision=DOT_PRECISION)
    # dK^T, dV^T [D, BLOCK_N] stored through transposed offsets. Unsigned, their 64-bit extension is a zero
    # high word: signed ones kept four sign words live across the loop, which spilled.
    o_kvt = (o_n[None, :] * stride_k + o_d[:, None]).to(tl.uint32)
    m_keyt = (o_n < n_ctx)[None, :]
    tl.store(dk_ctx_ptr + ctx_offset + o_kvt, (b_dkt * scale).to(dk_ctx_ptr.dtype.element_ty), mask=m_keyt)
    tl.store(dv_ctx_ptr + ctx_offset + o_kvt, b_dvt.to(dv_ctx_ptr.dtype.element_ty), mask=m_keyt)


# ---------------------------------------------------------------- host functions


class VisibilityPlan(NamedTuple):
    """Per-anchor context intervals (spec.md §4) for the kernels.

    lo, hi: [R, A] int32, slot 0 of anchor i sees context keys lo <= p < hi (0, 0 when invalid);
    valid: [R, A] int32 (1 = valid anchor);
    query_window: 0 when every slot sees [lo, hi) (no window, or window_from "anchor"); W with a per-query
    window (window_from "query"): slot j sees [max(lo, hi - W + 1 + j), hi).
    """

    lo: torch.Tensor
    hi: torch.Tensor
    valid: torch.Tensor
    query_window: int


def visibility_plan(
    anchors: torch.Tensor, anchor_valid: torch.Tensor, document_ids: torch.Tensor, window: Optional[int],
    window_from: str = "anchor",
) -> VisibilityPlan:
    """anchors [R, A], anchor_valid [R, A], document_ids [R, T] (contiguous runs) -> VisibilityPlan, O(A + T).

    doc[p] == doc[a] and p < a  <=>  doc_start(a) <= p < a, because documents are runs. A window W starts
    slot 0's context at a - W (window_from "anchor"), or at a - W + 1 (window_from "query": W keys up to the
    query's own position, itself included).
    """
    t = document_ids.shape[1]
    anchors = anchors.long()
    lo = document_starts(document_ids).gather(1, anchors.clamp(0, t - 1))
    query = window is not None and window_from == "query"
    if window is not None:
        lo = torch.maximum(lo, anchors - window + int(query))
    hi = anchors.clamp(0, t)
    hi = torch.maximum(hi, lo)
    valid = anchor_valid.bool()
    zero = torch.zeros_like(lo)
    return VisibilityPlan(torch.where(valid, lo, zero).int(), torch.where(valid, hi, zero).int(), valid.int(),
                          window if query else 0)


class ContextRanges(NamedTuple):
    """What the context dK/dV pass needs to find the anchors of a key tile, from monotone envelopes of the
    bounds over valid anchors: exact for sorted anchors, a superset (or a looser bound) otherwise.

    first, last: [R, T] int32, the valid anchors that may see context key p lie in [first[p], last[p]);
    lo_max: [R, A] int32, the running max of lo (0 for invalid anchors) up to anchor i;
    hi_min: [R, A] int32, the suffix min of hi (T for invalid anchors) from anchor i on: every valid anchor
    of [a0, a1) sees [lo_max[a1 - 1], hi_min[a0]) whole.
    """

    first: torch.Tensor
    last: torch.Tensor
    lo_max: torch.Tensor
    hi_min: torch.Tensor


def _suffix_min(x: torch.Tensor) -> torch.Tensor:
    return x.flip(1).cummin(dim=1).values.flip(1)


def context_ranges(plan: VisibilityPlan, n_ctx: int, block_size: int) -> ContextRanges:
    """The ContextRanges of a plan over n_ctx context keys, O(A + T) on the plan's device. The anchors that
    may see a key come from slot 0's intervals (which hold every slot's); whether a tile's anchors see a key
    tile whole from the last slot's lower end (the largest with a per-query window)."""
    valid = plan.valid.bool()
    lo, hi = plan.lo.long(), plan.hi.long()
    lo_last = torch.maximum(lo, hi - plan.query_window + block_size) if plan.query_window else lo
    hi_running_max = torch.where(valid, hi, 0).cummax(dim=1).values
    lo_suffix_min = _suffix_min(torch.where(valid, lo, n_ctx))
    p = torch.arange(n_ctx, device=plan.lo.device).expand(plan.lo.shape[0], n_ctx).contiguous()
    first = torch.searchsorted(hi_running_max, p, right=True)  # first anchor whose interval ends after p
    last = torch.searchsorted(lo_suffix_min, p, right=True)  # first anchor whose interval starts after p
    lo_max = torch.where(valid, lo_last, 0).cummax(dim=1).values
    hi_min = _suffix_min(torch.where(valid, hi, n_ctx))
    return ContextRanges(first.int(), last.int(), lo_max.int(), hi_min.int())


def pack_rows(block_size: int) -> int:
    """BLOCK_P, the rows of one pack of whole blocks: 16 (tl.dot's smallest side), or the block size
    rounded up to a power of two when it is larger."""
    return max(16, triton.next_power_of_2(block_size))


def anchors_per_tile(block_m: int, block_size: int) -> int:
    """Anchors in an anchor tile of block_m rows."""
    block_p = pack_rows(block_size)
    return block_m // block_p * (block_p // block_size)


def _check_inputs(q, k_ctx, v_ctx, k_blk, v_blk, anchors, anchor_valid, document_ids, block_size):
    if q.dim() != 4:
        raise ValueError(f"q must be [R, A*B, Hq, D], got shape {tuple(q.shape)}")
    r, n_q, hq, d = q.shape
    for name, x in (("k_ctx", k_ctx), ("v_ctx", v_ctx), ("k_blk", k_blk), ("v_blk", v_blk)):
        if x.dim() != 4 or x.shape[0] != r or x.shape[3] != d or x.shape[2] != k_ctx.shape[2]:
            raise ValueError(f"{name} has shape {tuple(x.shape)}; expected [R={r}, *, Hkv={k_ctx.shape[2]}, D={d}]")
        if x.dtype != q.dtype or x.device != q.device:
            raise ValueError(
                f"{name} is {x.dtype} on {x.device} but q is {q.dtype} on {q.device}; cast them to one dtype and device"
            )
    check_device("anchored_attention", q)
    t, hkv = k_ctx.shape[1], k_ctx.shape[2]
    if v_ctx.shape[1] != t or k_blk.shape[1] != n_q or v_blk.shape[1] != n_q:
        raise ValueError(
            f"k_ctx/v_ctx need T={t} rows and k_blk/v_blk need A*B={n_q} rows, got {tuple(v_ctx.shape)}, "
            f"{tuple(k_blk.shape)}, {tuple(v_blk.shape)}"
        )
    if hq % hkv != 0:
        raise ValueError(f"Hq={hq} is not a multiple of Hkv={hkv} (GQA needs Hq = g * Hkv)")
    if d < 16 or d > 128 or d & (d - 1):
        raise ValueError(
            f"head dim {d} is not supported by the Triton kernel: use a power of two in 16..128, or the eager backend"
        )
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q dtype {q.dtype} is not supported: use float32, float16 or bfloat16")
    if anchors.dim() != 2 or anchors.shape[0] != r or anchors.shape[1] * block_size != n_q:
        raise ValueError(
            f"anchors has shape {tuple(anchors.shape)} but q has A*B={n_q} rows with "
            f"block_size={block_size}; anchors must be [R, A] with A*B = q.shape[1]"
        )
    smallest_tile = min([c.kwargs["BLOCK_M"] for c in _Q_TILE_CONFIGS + _KEY_TILE_CONFIGS] + [_BLOCK_PASS_ROWS])
    if pack_rows(block_size) > smallest_tile:
        raise ValueError(
            f"block_size={block_size} does not fit the kernel's {smallest_tile}-row query tiles (a tile holds "
            f"whole blocks, padded to a power of two): use a block size <= {smallest_tile}, or the eager backend"
        )
    if anchor_valid.shape != anchors.shape:
        raise ValueError(
            f"anchor_valid has shape {tuple(anchor_valid.shape)}, anchors {tuple(anchors.shape)}: they must match"
        )
    if document_ids.shape != (r, t) or t < 1:
        raise ValueError(f"document_ids has shape {tuple(document_ids.shape)}; expected [R={r}, T={t}] with T >= 1")
    for name, x in (("q", q), ("k_ctx", k_ctx), ("k_blk", k_blk)):
        if x[0].numel() >= 2**31:
            raise ValueError(
                f"one row of {name} has {x[0].numel()} elements (shape {tuple(x.shape)}), but the kernel addresses "
                "a row with int32 offsets: pack shorter rows (smaller T or A)"
            )


def anchored_attention_forward(
    q: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
    plan: VisibilityPlan,
    block_size: int,
    causal_in_block: bool,
    scale: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """q [R, A*B, Hq, D], k_ctx/v_ctx [R, T, Hkv, D], k_blk/v_blk [R, A*B, Hkv, D] (all contiguous)
    -> out [R, A*B, Hq, D] (q.dtype), lse [R, Hq, A*B] fp32 base-2 log-sum-exp of the scaled scores."""
    r, n_q, hq, d = q.shape
    t, hkv = k_ctx.shape[1], k_ctx.shape[2]
    n_anchor = plan.lo.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty((r, hq, n_q), dtype=torch.float32, device=q.device)
    grid = lambda meta: (r * hq, triton.cdiv(n_anchor, anchors_per_tile(meta["BLOCK_M"], block_size)))
    _attn_fwd_kernel[grid](
        q, k_ctx, v_ctx, k_blk, v_blk,
        out, lse,
        *plan,
        t, n_anchor, hq, hq // hkv, scale * math.log2(math.e),
        BLOCK_SIZE=block_size, CAUSAL=causal_in_block, HEAD_DIM=d, BLOCK_P=pack_rows(block_size),
        DOT_PRECISION=dot_precision(q.dtype),
    )
    return out, lse


def anchored_attention_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    plan: VisibilityPlan,
    block_size: int,
    causal_in_block: bool,
    scale: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """do [R, A*B, Hq, D] plus the forward's (contiguous) inputs, out and lse -> dq, dk_ctx, dv_ctx, dk_blk,
    dv_blk (shapes and dtypes of q, k_ctx, v_ctx, k_blk, v_blk)."""
    r, n_q, hq, d = q.shape
    t, hkv = k_ctx.shape[1], k_ctx.shape[2]
    group = hq // hkv
    n_anchor = plan.lo.shape[1]
    block_p = pack_rows(block_size)
    qk_scale = scale * math.log2(math.e)
    precision = dot_precision(q.dtype)
    do = do.contiguous()
    delta = torch.empty_like(lse)
    dk_blk, dv_blk = torch.empty_like(k_blk), torch.empty_like(v_blk)
    _attn_bwd_block_kernel[(triton.cdiv(n_anchor, anchors_per_tile(_BLOCK_PASS_ROWS, block_size)), r * hkv)](
        q, k_blk, v_blk, out, do, lse,
        delta, dk_blk, dv_blk,
        n_anchor, hq, group, qk_scale, scale,
        BLOCK_SIZE=block_size, CAUSAL=causal_in_block, HEAD_DIM=d, BLOCK_P=block_p, DOT_PRECISION=precision,
        BLOCK_M=_BLOCK_PASS_ROWS, num_warps=_BLOCK_PASS_WARPS, num_stages=_BLOCK_PASS_STAGES,
    )
    dq = torch.empty_like(q)
    grid_q = lambda meta: (r * hq, triton.cdiv(n_anchor, anchors_per_tile(meta["BLOCK_M"], block_size)))
    _attn_bwd_dq_kernel[grid_q](
        q, k_ctx, v_ctx, k_blk, v_blk,
        do, lse, delta, dq,
        *plan,
        t, n_anchor, hq, group, qk_scale, scale,
        BLOCK_SIZE=block_size, CAUSAL=causal_in_block, HEAD_DIM=d, BLOCK_P=block_p, DOT_PRECISION=precision,
    )
    ranges = context_ranges(plan, t, block_size)
    dk_ctx, dv_ctx = torch.empty_like(k_ctx), torch.empty_like(v_ctx)
    grid_k = lambda meta: (r * triton.cdiv(t, meta["BLOCK_N"]) * hkv,)
    _attn_bwd_dkdv_kernel[grid_k](
        q, k_ctx, v_ctx, do, lse, delta,
        dk_ctx, dv_ctx,
        plan.lo, plan.hi, plan.query_window, *ranges,
        t, n_anchor, hq, group, qk_scale, scale,
        BLOCK_SIZE=block_size, HEAD_DIM=d, BLOCK_P=block_p, DOT_PRECISION=precision,
    )
    return dq, dk_ctx, dv_ctx, dk_blk, dv_blk


class _AnchoredAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_ctx, v_ctx, k_blk, v_blk, plan_lo, plan_hi, plan_valid, query_window, block_size,
                causal_in_block, scale):
        plan = VisibilityPlan(plan_lo, plan_hi, plan_valid, query_window)
        out, lse = anchored_attention_forward(q, k_ctx, v_ctx, k_blk, v_blk, plan, block_size, causal_in_block, scale)
        ctx.save_for_backward(q, k_ctx, v_ctx, k_blk, v_blk, out, lse, plan_lo, plan_hi, plan_valid)
        ctx.query_window, ctx.block_size = query_window, block_size
        ctx.causal_in_block, ctx.scale = causal_in_block, scale
        return out

    @staticmethod
    def backward(ctx, do):
        q, k_ctx, v_ctx, k_blk, v_blk, out, lse, lo, hi, valid = ctx.saved_tensors
        plan = VisibilityPlan(lo, hi, valid, ctx.query_window)
        grads = anchored_attention_backward(
            do, q, k_ctx, v_ctx, k_blk, v_blk, out, lse, plan, ctx.block_size, ctx.causal_in_block, ctx.scale
        )
        return (*grads, None, None, None, None, None, None, None)


def anchored_attention(
    q: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    document_ids: torch.Tensor,
    block_size: int,
    window: Optional[int] = None,
    causal_in_block: bool = False,
    scale: Optional[float] = None,
    window_from: str = "anchor",
) -> torch.Tensor:
    """Anchored block attention of the drafter (spec.md §4), block-sparse Triton kernel.

    q: [R, A*B, Hq, D]; k_ctx, v_ctx: [R, T, Hkv, D]; k_blk, v_blk: [R, A*B, Hkv, D];
    anchors: [R, A] int, sorted, row positions; anchor_valid: [R, A] bool;
    document_ids: [R, T] (contiguous runs) -> out [R, A*B, Hq, D] in q.dtype.
    Rows of invalid anchors are zero and pass no gradient. Hq must be a multiple of
    Hkv (GQA); D a power of two in 16..128. Differentiable in q, k_ctx, v_ctx, k_blk, v_blk.
    Same semantics as `dflash_fast.drafter.eager.anchored_attention`.
    """
    _check_inputs(q, k_ctx, v_ctx, k_blk, v_blk, anchors, anchor_valid, document_ids, block_size)
    check_window(window, window_from, block_size)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    plan = visibility_plan(anchors.to(q.device), anchor_valid.to(q.device), document_ids.to(q.device), window,
                           window_from)
    q, k_ctx, v_ctx, k_blk, v_blk = (x.contiguous() for x in (q, k_ctx, v_ctx, k_blk, v_blk))
    return _AnchoredAttention.apply(q, k_ctx, v_ctx, k_blk, v_blk, *plan, block_size, causal_in_block, scale)
