"""Anchored block-sparse attention (SPEC §4): flash-style Triton forward and backward.

Query (anchor i, slot j) sees context keys p with doc_start(a_i) <= p < a_i (and
p >= a_i - W with a window) and the keys of its own block (slots j' <= j when
causal in block). Documents are contiguous runs, so each anchor's context is one
interval [lo_i, hi_i), computed on the host in O(A + T). No mask and no BlockMask
is built: a query tile visits only the context tiles in [min lo, max hi) of its
anchors, then its own block keys. Extra memory: the per-anchor bounds [R, A], two
per-position anchor ranges [R, T] for the backward, and the per-row log-sum-exp
and delta [R, Hq, A*B] (fp32).

Sorted anchors make the intervals monotone, which keeps a tile's context range
tight and makes the anchors that see one context tile a contiguous range; the
code stays correct (only slower) for unsorted valid anchors.
"""
import math
from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl
from dflash_fast.kernels._common import autotune_configs, check_device, dot_precision

from dflash_fast.eager import document_starts


def _configs(gpu_configs, interpreter_config):
    return autotune_configs(("BLOCK_M", "BLOCK_N"), gpu_configs, interpreter_config)


# (BLOCK_M, BLOCK_N, num_warps, num_stages). Candidates chosen to compile without register
# spills for D = 128 on sm_90 (checked with cuobjdump), plus one larger tile each.
# Query-tile kernels (forward, dq): BLOCK_M queries stay resident, BLOCK_N keys stream past.
_Q_TILE_CONFIGS = _configs(
    [(128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3), (64, 32, 4, 4), (128, 128, 8, 2), (128, 32, 8, 3)],
    (32, 32, 4, 1),
)
# Key-tile kernel (dk/dv): BLOCK_N keys stay resident, BLOCK_M query rows stream past.
_KEY_TILE_CONFIGS = _configs(
    [(64, 64, 8, 3), (64, 64, 8, 2), (32, 64, 8, 3), (32, 64, 4, 3), (32, 128, 8, 3), (64, 128, 8, 2)],
    (32, 32, 4, 1),
)


@triton.jit
def _row_ptrs(base, stride, o_rows, o_d):
    """[len(o_rows), HEAD_DIM] pointers to rows o_rows of one head. Offsets inside a row
    are int32 (the host checks that a row spans < 2^31 elements): int64 offsets made
    the kernels spill registers on sm_90."""
    return base + o_rows[:, None] * stride + o_d[None, :]


@triton.jit
def _load_rows(base, stride, o_rows, o_d, n_rows):
    """Rows o_rows of one head, zero past n_rows."""
    return tl.load(_row_ptrs(base, stride, o_rows, o_d), mask=(o_rows < n_rows)[:, None], other=0.0)


@triton.jit
def _query_tile(LO, HI, VALID, n_ctx, n_q, n_qh, n_anchor, group, block_size,
                CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program ids (grid: query tiles x R*Hq) -> the tile's rows and the key tiles it visits.

    Returns row r (int64), q head, kv head, offsets o_m [BLOCK_M] and o_d [HEAD_DIM];
    per query row its anchor's context interval lo, hi and validity; then c_lo and
    n_ctx_tiles (context tiles covering [min lo, max hi) of the valid rows), lo_max and hi_min (tiles
    inside [lo_max, hi_min) are seen whole by every valid row), b_lo (first key of the tile's own blocks)
    and n_tiles (context + block tiles). A tile without valid rows visits nothing.
    """
    # Later anchors see more context: launch the heavy tiles first to shorten the tail.
    i_m = tl.num_programs(0) - 1 - tl.program_id(0)
    i_rh = tl.program_id(1)
    i_r, i_h = i_rh // n_qh, i_rh % n_qh
    r64 = i_r.to(tl.int64)
    m0 = i_m * BLOCK_M
    o_m = m0 + tl.arange(0, BLOCK_M)
    m_row = o_m < n_q
    o_anchor = o_m // block_size
    valid = tl.load(VALID + r64 * n_anchor + o_anchor, mask=m_row, other=0) != 0
    lo = tl.where(valid, tl.load(LO + r64 * n_anchor + o_anchor, mask=m_row, other=0), 0)
    hi = tl.where(valid, tl.load(HI + r64 * n_anchor + o_anchor, mask=m_row, other=0), 0)

    any_valid = tl.max(valid.to(tl.int32), axis=0) > 0
    lo_min = tl.min(tl.where(valid, lo, n_ctx), axis=0)
    lo_max = tl.max(tl.where(valid, lo, 0), axis=0)
    hi_min = tl.min(tl.where(valid, hi, n_ctx), axis=0)
    hi_max = tl.max(tl.where(valid, hi, 0), axis=0)
    c_lo = (lo_min // BLOCK_N) * BLOCK_N
    n_ctx_tiles = tl.where(any_valid, tl.cdiv(tl.maximum(hi_max - c_lo, 0), BLOCK_N), 0)
    m_last = tl.minimum(m0 + BLOCK_M, n_q) - 1
    b_lo = (m0 // block_size) * block_size
    b_hi = tl.minimum((m_last // block_size + 1) * block_size, n_q)
    if CAUSAL:
        b_hi = tl.minimum(b_hi, m_last + 1)
    n_blk_tiles = tl.where(any_valid, tl.cdiv(b_hi - b_lo, BLOCK_N), 0)
    return (
        r64,
        i_h,
        i_h // group,
        o_m,
        tl.arange(0, HEAD_DIM),
        lo,
        hi,
        valid,
        c_lo,
        n_ctx_tiles,
        lo_max,
        hi_min,
        b_lo,
        n_ctx_tiles + n_blk_tiles,
    )


@triton.jit
def _visible(o_m, o_n, lo, hi, block_size, IS_CTX: tl.constexpr, CAUSAL: tl.constexpr):
    """SPEC §4 visibility of keys o_n to query rows o_m (with their anchor's lo, hi), broadcast
    to 2-D by the caller ([M, 1] vs [1, N] or transposed). Row validity is handled elsewhere."""
    if IS_CTX:
        vis = (o_n >= lo) & (o_n < hi)
    else:
        vis = (o_n // block_size) == (o_m // block_size)
        if CAUSAL:
            vis = vis & (o_n <= o_m)
    return vis


@triton.jit
def _key_tile_scores(
    it,
    q,
    KC,
    VC,
    KB,
    VB,
    skc,
    svc,
    skb,
    svb,
    c_lo,
    n_ctx_tiles,
    lo_max,
    hi_min,
    b_lo,
    n_ctx,
    n_q,
    o_m,
    o_d,
    lo,
    hi,
    block_size,
    qk_scale,
    CAUSAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The it-th key tile of a query tile (context tiles, then block tiles) -> k, v [BLOCK_N, D]
    and base-2 scores s = scale * log2(e) * q k^T [BLOCK_M, BLOCK_N], -inf where not visible.

    One loop serves both key sources, so one set of loop state stays live (separate
    loops spilled registers on sm_90); only context tiles at the edges of the tile's
    intervals pay for the mask.
    """
    is_ctx = it < n_ctx_tiles
    if is_ctx:
        o_n = c_lo + it * BLOCK_N + tl.arange(0, BLOCK_N)
        k = _load_rows(KC, skc, o_n, o_d, n_ctx)
        v = _load_rows(VC, svc, o_n, o_d, n_ctx)
    else:
        o_n = b_lo + (it - n_ctx_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = _load_rows(KB, skb, o_n, o_d, n_q)
        v = _load_rows(VB, svb, o_n, o_d, n_q)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if is_ctx:
        n0 = c_lo + it * BLOCK_N
        if (n0 < lo_max) | (n0 + BLOCK_N > hi_min):
            s = tl.where(
                _visible(o_m[:, None], o_n[None, :], lo[:, None], hi[:, None], block_size, True, CAUSAL),
                s,
                float("-inf"),
            )
    else:
        s = tl.where(
            _visible(o_m[:, None], o_n[None, :], lo[:, None], hi[:, None], block_size, False, CAUSAL), s, float("-inf")
        )
    return k, v, s


@triton.autotune(configs=_Q_TILE_CONFIGS, key=["n_ctx", "n_q", "block_size", "HEAD_DIM", "CAUSAL"])
@triton.jit
def _attn_fwd_kernel(
    Q,
    KC,
    VC,
    KB,
    VB,
    OUT,
    LSE,
    LO,
    HI,
    VALID,
    sq_r,
    sq_m,
    sq_h,
    skc_r,
    skc_t,
    skc_h,
    svc_r,
    svc_t,
    svc_h,
    skb_r,
    skb_m,
    skb_h,
    svb_r,
    svb_m,
    svb_h,
    so_r,
    so_m,
    so_h,
    n_ctx,
    n_q,
    n_anchor,
    n_qh,
    group,
    block_size,
    qk_scale,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """OUT = softmax(scale * Q K^T over visible keys) V for one (row, q head, query tile); LSE in base 2.

    Reads its query tile once and K/V of context tiles [min lo, max hi) plus its own
    blocks; writes OUT [BLOCK_M, D] and LSE [BLOCK_M] (+inf on invalid rows).
    """
    r64, i_h, i_hk, o_m, o_d, lo, hi, valid, c_lo, n_ctx_tiles, lo_max, hi_min, b_lo, n_tiles = _query_tile(
        LO, HI, VALID, n_ctx, n_q, n_qh, n_anchor, group, block_size, CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N
    )
    q = _load_rows(Q + r64 * sq_r + i_h * sq_h, sq_m, o_m, o_d, n_q)
    KCh, VCh = KC + r64 * skc_r + i_hk * skc_h, VC + r64 * svc_r + i_hk * svc_h
    KBh, VBh = KB + r64 * skb_r + i_hk * skb_h, VB + r64 * svb_r + i_hk * svb_h

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for it in range(n_tiles):
        k, v, s = _key_tile_scores(
            it,
            q,
            KCh,
            VCh,
            KBh,
            VBh,
            skc_t,
            svc_t,
            skb_m,
            svb_m,
            c_lo,
            n_ctx_tiles,
            lo_max,
            hi_min,
            b_lo,
            n_ctx,
            n_q,
            o_m,
            o_d,
            lo,
            hi,
            block_size,
            qk_scale,
            CAUSAL,
            BLOCK_N,
            DOT_PRECISION,
        )
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with nothing visible yet keeps m = -inf; subtract 0 there so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # A valid row always sees its own slot, so l > 0 there; invalid rows are zero.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = tl.where(valid[:, None], acc / l_safe[:, None], 0.0)
    lse = tl.where(valid, m_i + tl.log2(l_safe), float("inf"))
    m_row = o_m < n_q
    p_out = _row_ptrs(OUT + r64 * so_r + i_h * so_h, so_m, o_m, o_d)
    tl.store(p_out, out.to(OUT.dtype.element_ty), mask=m_row[:, None])
    tl.store(LSE + (r64 * n_qh + i_h) * n_q + o_m, lse, mask=m_row)


@triton.jit
def _bwd_preprocess_kernel(
    OUT, DO, DELTA, so_r, so_m, so_h, sdo_r, sdo_m, sdo_h, n_q, n_qh, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr
):
    """delta[r, h, m] = sum_d dO * OUT (fp32): the softmax-backward row term."""
    i_m, i_rh = tl.program_id(0), tl.program_id(1)
    i_h = i_rh % n_qh
    r64 = (i_rh // n_qh).to(tl.int64)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, HEAD_DIM)
    o = _load_rows(OUT + r64 * so_r + i_h * so_h, so_m, o_m, o_d, n_q).to(tl.float32)
    do = _load_rows(DO + r64 * sdo_r + i_h * sdo_h, sdo_m, o_m, o_d, n_q).to(tl.float32)
    tl.store(DELTA + (r64 * n_qh + i_h) * n_q + o_m, tl.sum(o * do, axis=1), mask=o_m < n_q)


@triton.autotune(configs=_Q_TILE_CONFIGS, key=["n_ctx", "n_q", "block_size", "HEAD_DIM", "CAUSAL"])
@triton.jit
def _attn_bwd_dq_kernel(
    Q,
    KC,
    VC,
    KB,
    VB,
    DO,
    LSE,
    DELTA,
    DQ,
    LO,
    HI,
    VALID,
    sq_r,
    sq_m,
    sq_h,
    skc_r,
    skc_t,
    skc_h,
    svc_r,
    svc_t,
    svc_h,
    skb_r,
    skb_m,
    skb_h,
    svb_r,
    svb_m,
    svb_h,
    sdo_r,
    sdo_m,
    sdo_h,
    sdq_r,
    sdq_m,
    sdq_h,
    n_ctx,
    n_q,
    n_anchor,
    n_qh,
    group,
    block_size,
    qk_scale,
    scale,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dQ = scale * dS K for one (row, q head, query tile), dS = P * (dO V^T - delta), P
    recomputed from the saved LSE; visits exactly the key tiles the forward visited.
    Invalid rows carry LSE = +inf, so P = 0 and their dQ is zero without a mask.
    """
    r64, i_h, i_hk, o_m, o_d, lo, hi, valid, c_lo, n_ctx_tiles, lo_max, hi_min, b_lo, n_tiles = _query_tile(
        LO, HI, VALID, n_ctx, n_q, n_qh, n_anchor, group, block_size, CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N
    )
    m_row = o_m < n_q
    q = _load_rows(Q + r64 * sq_r + i_h * sq_h, sq_m, o_m, o_d, n_q)
    do = _load_rows(DO + r64 * sdo_r + i_h * sdo_h, sdo_m, o_m, o_d, n_q)
    o_stat = (r64 * n_qh + i_h) * n_q + o_m
    lse = tl.load(LSE + o_stat, mask=m_row, other=float("inf"))
    delta = tl.load(DELTA + o_stat, mask=m_row, other=0.0)
    KCh, VCh = KC + r64 * skc_r + i_hk * skc_h, VC + r64 * svc_r + i_hk * svc_h
    KBh, VBh = KB + r64 * skb_r + i_hk * skb_h, VB + r64 * svb_r + i_hk * svb_h

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for it in range(n_tiles):
        k, v, s = _key_tile_scores(
            it,
            q,
            KCh,
            VCh,
            KBh,
            VBh,
            skc_t,
            svc_t,
            skb_m,
            svb_m,
            c_lo,
            n_ctx_tiles,
            lo_max,
            hi_min,
            b_lo,
            n_ctx,
            n_q,
            o_m,
            o_d,
            lo,
            hi,
            block_size,
            qk_scale,
            CAUSAL,
            BLOCK_N,
            DOT_PRECISION,
        )
        p = tl.exp2(s - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    tl.store(
        _row_ptrs(DQ + r64 * sdq_r + i_h * sdq_h, sdq_m, o_m, o_d),
        (dq * scale).to(DQ.dtype.element_ty),
        mask=m_row[:, None],
    )


@triton.autotune(configs=_KEY_TILE_CONFIGS, key=["n_keys", "n_q", "block_size", "HEAD_DIM", "CAUSAL", "IS_CTX"])
@triton.jit
def _attn_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    LO,
    HI,
    Q_FIRST,
    Q_LAST,
    sq_r,
    sq_m,
    sq_h,
    sk_r,
    sk_n,
    sk_h,
    sv_r,
    sv_n,
    sv_h,
    sdo_r,
    sdo_m,
    sdo_h,
    sdk_r,
    sdk_n,
    sdk_h,
    sdv_r,
    sdv_n,
    sdv_h,
    n_keys,
    n_q,
    n_anchor,
    n_qh,
    group,
    block_size,
    qk_scale,
    scale,
    IS_CTX: tl.constexpr,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dV = P^T dO, dK = scale * dS^T Q for one (row, kv head, key tile), summed over the
    `group` query heads that share it.

    Context keys (IS_CTX): the query rows are the anchors [Q_FIRST[n0], Q_LAST[n1 - 1])
    that can see the tile, a contiguous range for sorted anchors. Block keys: the
    queries of the same blocks. Each program owns its output tile: no atomics.
    """
    i_n, i_rh = tl.program_id(0), tl.program_id(1)
    n_kh = n_qh // group
    i_hk = i_rh % n_kh
    r64 = (i_rh // n_kh).to(tl.int64)
    n0 = i_n * BLOCK_N
    o_n = n0 + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, HEAD_DIM)
    k = _load_rows(K + r64 * sk_r + i_hk * sk_h, sk_n, o_n, o_d, n_keys)
    v = _load_rows(V + r64 * sv_r + i_hk * sv_h, sv_n, o_n, o_d, n_keys)
    n_last = tl.minimum(n0 + BLOCK_N, n_keys) - 1
    if IS_CTX:
        q_lo = tl.load(Q_FIRST + r64 * n_keys + n0) * block_size
        q_hi = tl.minimum(tl.load(Q_LAST + r64 * n_keys + n_last) * block_size, n_q)
    else:
        q_lo = (n0 // block_size) * block_size
        if CAUSAL:
            # Rows before the tile see no key in it (slot j sees j' <= j only).
            q_lo = n0
        q_hi = tl.minimum((n_last // block_size + 1) * block_size, n_q)
    LOr, HIr = LO + r64 * n_anchor, HI + r64 * n_anchor

    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for g in range(group):
        i_h = i_hk * group + g
        Qh, DOh = Q + r64 * sq_r + i_h * sq_h, DO + r64 * sdo_r + i_h * sdo_h
        LSEh, DELTAh = LSE + (r64 * n_qh + i_h) * n_q, DELTA + (r64 * n_qh + i_h) * n_q
        for m0 in range(q_lo, q_hi, BLOCK_M):
            o_m = m0 + tl.arange(0, BLOCK_M)
            m_row = o_m < q_hi
            q = _load_rows(Qh, sq_m, o_m, o_d, q_hi)
            do = _load_rows(DOh, sdo_m, o_m, o_d, q_hi)
            # +inf LSE (invalid anchors, rows outside the range) makes P exactly 0.
            lse = tl.load(LSEh + o_m, mask=m_row, other=float("inf"))
            delta = tl.load(DELTAh + o_m, mask=m_row, other=0.0)
            p_t = tl.exp2(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale - lse[None, :])
            if IS_CTX:
                lo = tl.load(LOr + o_m // block_size, mask=m_row, other=0)
                hi = tl.load(HIr + o_m // block_size, mask=m_row, other=0)
                live = lse != float("inf")
                # Only key tiles at the edge of some live row's interval need the mask.
                if (tl.max(tl.where(live, lo, 0), axis=0) > n0) | (
                    tl.min(tl.where(live, hi, n_keys), axis=0) < n0 + BLOCK_N
                ):
                    p_t = tl.where(
                        _visible(o_m[None, :], o_n[:, None], lo[None, :], hi[None, :], block_size, True, CAUSAL),
                        p_t,
                        0.0,
                    )
            else:
                p_t = tl.where(_visible(o_m[None, :], o_n[:, None], 0, 0, block_size, False, CAUSAL), p_t, 0.0)
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    m_key = (o_n < n_keys)[:, None]
    tl.store(
        _row_ptrs(DK + r64 * sdk_r + i_hk * sdk_h, sdk_n, o_n, o_d), (dk * scale).to(DK.dtype.element_ty), mask=m_key
    )
    tl.store(_row_ptrs(DV + r64 * sdv_r + i_hk * sdv_h, sdv_n, o_n, o_d), dv.to(DV.dtype.element_ty), mask=m_key)


class VisibilityPlan(NamedTuple):
    """Per-anchor context intervals (SPEC §4) for the kernels.

    lo, hi: [R, A] int32, anchor i sees context keys lo <= p < hi (0, 0 when invalid);
    valid: [R, A] int32 (1 = valid anchor).
    """

    lo: torch.Tensor
    hi: torch.Tensor
    valid: torch.Tensor


def visibility_plan(
    anchors: torch.Tensor, anchor_valid: torch.Tensor, document_ids: torch.Tensor, window: Optional[int]
) -> VisibilityPlan:
    """anchors [R, A], anchor_valid [R, A], document_ids [R, T] (contiguous runs) -> VisibilityPlan, O(A + T).

    doc[p] == doc[a] and p < a  <=>  doc_start(a) <= p < a, because documents are runs.
    """
    t = document_ids.shape[1]
    anchors = anchors.long()
    lo = document_starts(document_ids).gather(1, anchors.clamp(0, t - 1))
    if window is not None:
        lo = torch.maximum(lo, anchors - window)
    hi = anchors.clamp(0, t)
    hi = torch.maximum(hi, lo)
    valid = anchor_valid.bool()
    zero = torch.zeros_like(lo)
    return VisibilityPlan(torch.where(valid, lo, zero).int(), torch.where(valid, hi, zero).int(), valid.int())


def context_query_ranges(plan: VisibilityPlan, n_ctx: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """[R, T] int32 first, last: the valid anchors that may see context key p lie in [first[p], last[p]).

    Uses monotone envelopes of the bounds (running max of hi, suffix min of lo over
    valid anchors), so the range is exact for sorted anchors and a superset otherwise.
    """
    valid = plan.valid.bool()
    hi_env = torch.where(valid, plan.hi, torch.zeros_like(plan.hi)).long().cummax(dim=1).values
    lo_env = torch.where(valid, plan.lo, torch.full_like(plan.lo, n_ctx)).long().flip(1).cummin(dim=1).values.flip(1)
    p = torch.arange(n_ctx, device=plan.lo.device).expand(plan.lo.shape[0], n_ctx).contiguous()
    first = torch.searchsorted(hi_env, p, right=True)  # first anchor whose interval ends after p
    last = torch.searchsorted(lo_env, p, right=True)  # first anchor whose interval starts after p
    return first.int(), last.int()


def _strides3(x: torch.Tensor) -> Tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


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
    if anchor_valid.shape != anchors.shape:
        raise ValueError(
            f"anchor_valid has shape {tuple(anchor_valid.shape)}, anchors {tuple(anchors.shape)}: they must match"
        )
    if document_ids.shape != (r, t) or t < 1:
        raise ValueError(f"document_ids has shape {tuple(document_ids.shape)}; expected [R={r}, T={t}] with T >= 1")
    _check_row_span(q=q, k_ctx=k_ctx, v_ctx=v_ctx, k_blk=k_blk, v_blk=v_blk)


def _check_row_span(**tensors: torch.Tensor) -> None:
    """The kernels address inside one row with int32 offsets."""
    for name, x in tensors.items():
        span = 1 + sum((n - 1) * st for n, st in zip(x.shape[1:], x.stride()[1:]))
        if span >= 2**31:
            raise ValueError(
                f"one row of {name} spans {span} elements (shape {tuple(x.shape)}, strides {x.stride()}); "
                f"the kernel addresses a row with int32 offsets: pack shorter rows (smaller T or A) or "
                f"make {name} contiguous"
            )


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


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
    """q [R, A*B, Hq, D], k_ctx/v_ctx [R, T, Hkv, D], k_blk/v_blk [R, A*B, Hkv, D] (last dim contiguous)
    -> out [R, A*B, Hq, D] (q.dtype), lse [R, Hq, A*B] fp32 base-2 log-sum-exp of the scaled scores."""
    r, n_q, hq, d = q.shape
    t, hkv = k_ctx.shape[1], k_ctx.shape[2]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((r, hq, n_q), dtype=torch.float32, device=q.device)
    grid = lambda meta: (triton.cdiv(n_q, meta["BLOCK_M"]), r * hq)
    _attn_fwd_kernel[grid](
        q,
        k_ctx,
        v_ctx,
        k_blk,
        v_blk,
        out,
        lse,
        plan.lo,
        plan.hi,
        plan.valid,
        *_strides3(q),
        *_strides3(k_ctx),
        *_strides3(v_ctx),
        *_strides3(k_blk),
        *_strides3(v_blk),
        *_strides3(out),
        t,
        n_q,
        plan.lo.shape[1],
        hq,
        hq // hkv,
        block_size,
        scale * math.log2(math.e),
        CAUSAL=causal_in_block,
        HEAD_DIM=d,
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
    """do [R, A*B, Hq, D] plus the forward's inputs, out and lse -> dq, dk_ctx, dv_ctx, dk_blk, dv_blk
    (shapes and dtypes of q, k_ctx, v_ctx, k_blk, v_blk)."""
    r, n_q, hq, d = q.shape
    t, hkv = k_ctx.shape[1], k_ctx.shape[2]
    group = hq // hkv
    n_anchor = plan.lo.shape[1]
    qk_scale = scale * math.log2(math.e)
    precision = dot_precision(q.dtype)
    do = _last_dim_contiguous(do)
    _check_row_span(grad_out=do)
    delta = torch.empty_like(lse)
    _bwd_preprocess_kernel[(triton.cdiv(n_q, 64), r * hq)](
        out,
        do,
        delta,
        *_strides3(out),
        *_strides3(do),
        n_q,
        hq,
        HEAD_DIM=d,
        BLOCK_M=64,
    )
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    grid_q = lambda meta: (triton.cdiv(n_q, meta["BLOCK_M"]), r * hq)
    _attn_bwd_dq_kernel[grid_q](
        q,
        k_ctx,
        v_ctx,
        k_blk,
        v_blk,
        do,
        lse,
        delta,
        dq,
        plan.lo,
        plan.hi,
        plan.valid,
        *_strides3(q),
        *_strides3(k_ctx),
        *_strides3(v_ctx),
        *_strides3(k_blk),
        *_strides3(v_blk),
        *_strides3(do),
        *_strides3(dq),
        t,
        n_q,
        n_anchor,
        hq,
        group,
        block_size,
        qk_scale,
        scale,
        CAUSAL=causal_in_block,
        HEAD_DIM=d,
        DOT_PRECISION=precision,
    )
    q_first, q_last = context_query_ranges(plan, t)
    grads = []
    for k, v, is_ctx in ((k_ctx, v_ctx, True), (k_blk, v_blk, False)):
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)
        dv = torch.empty_like(v, memory_format=torch.contiguous_format)
        n_keys = k.shape[1]
        grid_k = lambda meta, n_keys=n_keys: (triton.cdiv(n_keys, meta["BLOCK_N"]), r * hkv)
        _attn_bwd_dkdv_kernel[grid_k](
            q,
            k,
            v,
            do,
            lse,
            delta,
            dk,
            dv,
            plan.lo,
            plan.hi,
            q_first,
            q_last,
            *_strides3(q),
            *_strides3(k),
            *_strides3(v),
            *_strides3(do),
            *_strides3(dk),
            *_strides3(dv),
            n_keys,
            n_q,
            n_anchor,
            hq,
            group,
            block_size,
            qk_scale,
            scale,
            IS_CTX=is_ctx,
            CAUSAL=causal_in_block,
            HEAD_DIM=d,
            DOT_PRECISION=precision,
        )
        grads += [dk, dv]
    return dq, grads[0], grads[1], grads[2], grads[3]


class _AnchoredAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_ctx, v_ctx, k_blk, v_blk, plan_lo, plan_hi, plan_valid, block_size, causal_in_block, scale):
        plan = VisibilityPlan(plan_lo, plan_hi, plan_valid)
        out, lse = anchored_attention_forward(q, k_ctx, v_ctx, k_blk, v_blk, plan, block_size, causal_in_block, scale)
        ctx.save_for_backward(q, k_ctx, v_ctx, k_blk, v_blk, out, lse, plan_lo, plan_hi, plan_valid)
        ctx.block_size, ctx.causal_in_block, ctx.scale = block_size, causal_in_block, scale
        return out

    @staticmethod
    def backward(ctx, do):
        q, k_ctx, v_ctx, k_blk, v_blk, out, lse, lo, hi, valid = ctx.saved_tensors
        grads = anchored_attention_backward(
            do,
            q,
            k_ctx,
            v_ctx,
            k_blk,
            v_blk,
            out,
            lse,
            VisibilityPlan(lo, hi, valid),
            ctx.block_size,
            ctx.causal_in_block,
            ctx.scale,
        )
        return (*grads, None, None, None, None, None, None)


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
) -> torch.Tensor:
    """Anchored block attention of the drafter (SPEC §4), block-sparse Triton kernel.

    q: [R, A*B, Hq, D]; k_ctx, v_ctx: [R, T, Hkv, D]; k_blk, v_blk: [R, A*B, Hkv, D];
    anchors: [R, A] int, sorted, row positions; anchor_valid: [R, A] bool;
    document_ids: [R, T] (contiguous runs) -> out [R, A*B, Hq, D] in q.dtype.
    Rows of invalid anchors are zero and pass no gradient. Hq must be a multiple of
    Hkv (GQA); D a power of two in 16..128. Differentiable in q, k_ctx, v_ctx, k_blk, v_blk.
    Same semantics as `dflash_fast.eager.anchored_attention`.
    """
    _check_inputs(q, k_ctx, v_ctx, k_blk, v_blk, anchors, anchor_valid, document_ids, block_size)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    plan = visibility_plan(anchors.to(q.device), anchor_valid.to(q.device), document_ids.to(q.device), window)
    q, k_ctx, v_ctx, k_blk, v_blk = map(_last_dim_contiguous, (q, k_ctx, v_ctx, k_blk, v_blk))
    return _AnchoredAttention.apply(
        q, k_ctx, v_ctx, k_blk, v_blk, plan.lo, plan.hi, plan.valid, block_size, causal_in_block, scale
    )
