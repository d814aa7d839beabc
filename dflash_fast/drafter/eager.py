"""Eager twins of the three hot ops: spec.md §3-5 in plain PyTorch.

These are the oracles the Triton kernels are tested against, and the path that
runs on CPU. They favour clarity over memory: the attention builds its dense
mask, the loss materialises `[N, V]` logits. Every function here has the exact
signature of its kernel in `dflash_fast/kernels/<op>.py`; `dflash_fast.drafter.ops`
chooses between them.
"""

import math
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

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
    needs_last,
)
from dflash_fast.drafter.masks import check_window
from dflash_fast.target.norm import rms_norm


def stack_layers(hidden: Union[torch.Tensor, Sequence[torch.Tensor]]) -> torch.Tensor:
    """[N, K, H_t] tensor, or K tensors [N, H_t] -> [N, K, H_t]."""
    if isinstance(hidden, torch.Tensor):
        if hidden.dim() != 3:
            raise ValueError(f"hidden must be [N, K, H_t], got shape {tuple(hidden.shape)}")
        return hidden
    return torch.stack(list(hidden), dim=1)


def fc_concat(
    hidden: Union[torch.Tensor, Sequence[torch.Tensor]],
    fc_weight: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    noise_std: float = 0.0,
    seed: int = 0,
) -> torch.Tensor:
    """ctx = rms_norm(concat_k(hidden[:, k] + noise) @ fc_weight.T, norm_weight).

    hidden: [N, K, H_t] (any strides) or K tensors [N, H_t]; fc_weight: [H, K*H_t];
    norm_weight: [H] -> ctx [N, H]. `noise_std > 0` adds uniform noise in
    [-noise_std, noise_std) to the hidden states (training augmentation; the
    Triton kernel draws its own numbers from `seed`, so only the distribution is
    shared). Hidden states are data: no gradient flows into them.
    """
    x = stack_layers(hidden).detach()
    if noise_std > 0:
        gen = torch.Generator(device=x.device).manual_seed(seed)
        noise = torch.rand(x.shape, generator=gen, device=x.device, dtype=torch.float32)
        x = (x.float() + (2 * noise - 1) * noise_std).to(x.dtype)
    n, k, h_t = x.shape
    if fc_weight.shape[1] != k * h_t:
        raise ValueError(f"fc_weight is {tuple(fc_weight.shape)} but K*H_t = {k}*{h_t} = {k * h_t}")
    return rms_norm(F.linear(x.reshape(n, k * h_t), fc_weight), norm_weight, eps)


def context_visibility(
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    document_ids: torch.Tensor,
    block_size: int,
    window: Optional[int] = None,
    window_from: str = "anchor",
) -> torch.Tensor:
    """[R, A, B, T] bool: slot j of block i sees context key p iff doc[p] == doc[a_i] and p < a_i (strictly
    before the anchor) and, with a window W, p >= a_i - W (window_from "anchor": one window per block) or
    p > a_i + j - W (window_from "query": the window of the slot's own position a_i + j). Invalid anchors see
    nothing."""
    t = document_ids.shape[1]
    p = torch.arange(t, device=anchors.device)
    anchor_doc = document_ids.gather(1, anchors.clamp(0, t - 1))  # [R, A]
    ctx = (document_ids[:, None, :] == anchor_doc[:, :, None]) & (p[None, None, :] < anchors[:, :, None])
    ctx = ctx[:, :, None, :].expand(-1, -1, block_size, -1)
    if window is not None:
        j = torch.arange(block_size, device=anchors.device)
        first = anchors[:, :, None] - window if window_from == "anchor" else anchors[:, :, None] + j - window + 1
        ctx = ctx & (p[None, None, None, :] >= first[..., None])
    return ctx & anchor_valid[:, :, None, None]


def block_visibility(block_size: int, causal_in_block: bool, device=None) -> torch.Tensor:
    """[B, B] bool: slot j sees slot j' of its own block (all, or j' <= j when causal)."""
    ones = torch.ones(block_size, block_size, dtype=torch.bool, device=device)
    return torch.tril(ones) if causal_in_block else ones


def anchored_attention_mask(
    anchors: torch.Tensor, anchor_valid: torch.Tensor, document_ids: torch.Tensor, block_size: int,
    window: Optional[int] = None, causal_in_block: bool = False, window_from: str = "anchor",
) -> torch.Tensor:
    """spec.md §4 visibility as one dense boolean mask [R, A*B, T + A*B] (context keys, then block keys):
    context as in `context_visibility`, block keys of the query's own block only."""
    check_window(window, window_from, block_size)
    r, a = anchors.shape
    b = block_size
    ctx = context_visibility(anchors, anchor_valid, document_ids, b, window, window_from)
    same_block = torch.eye(a, dtype=torch.bool, device=anchors.device)
    blk = same_block[:, None, :, None] & block_visibility(b, causal_in_block, anchors.device)[None, :, None, :]
    blk = blk.reshape(1, a, b, a * b) & anchor_valid[:, :, None, None]
    return torch.cat([ctx, blk.expand(r, -1, -1, -1)], dim=-1).reshape(r, a * b, -1)


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
    """Anchored block attention of the drafter (spec.md §4), masked-softmax reference.

    q: [R, A*B, Hq, D]; k_ctx, v_ctx: [R, T, Hkv, D]; k_blk, v_blk: [R, A*B, Hkv, D];
    anchors: [R, A] int64, sorted, row positions; anchor_valid: [R, A] bool;
    document_ids: [R, T] (contiguous runs) -> out [R, A*B, Hq, D] in q.dtype.
    Rows of invalid anchors are zero. Hq must be a multiple of Hkv (GQA). window_from: where a window
    ends, `context_visibility`.
    Scores are [R, Hq, A, B, T + B]: every block against the whole context (masked) and against its
    own B slots; blocks never meet, so the [A*B, A*B] block-to-block scores are never formed.
    """
    check_window(window, window_from, block_size)
    r, n_q, hq, d = q.shape
    a, b = anchors.shape[1], block_size
    rep = hq // k_ctx.shape[2]
    scale = d ** -0.5 if scale is None else scale
    qb = q.float().view(r, a, b, hq, d)
    kc, vc = k_ctx.float().repeat_interleave(rep, dim=2), v_ctx.float().repeat_interleave(rep, dim=2)
    kb = k_blk.float().view(r, a, b, -1, d).repeat_interleave(rep, dim=3)
    vb = v_blk.float().view(r, a, b, -1, d).repeat_interleave(rep, dim=3)
    s_ctx = torch.einsum("rajhd,rthd->rhajt", qb, kc).masked_fill(
        ~context_visibility(anchors, anchor_valid, document_ids, b, window, window_from)[:, None], float("-inf"))
    s_blk = torch.einsum("rajhd,rakhd->rhajk", qb, kb).masked_fill(
        ~(block_visibility(b, causal_in_block, q.device) & anchor_valid[:, None, :, None, None]), float("-inf"))
    probs = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1) * scale, dim=-1).nan_to_num(0.0)  # invalid rows -> 0
    t = k_ctx.shape[1]
    out = torch.einsum("rhajt,rthd->rajhd", probs[..., :t], vc) + torch.einsum("rhajk,rakhd->rajhd", probs[..., t:], vb)
    return out.reshape(r, n_q, hq, d).to(q.dtype)


def dense_row_losses(kind: str, logq: torch.Tensor, logp: torch.Tensor):
    """Per-row loss [N] (differentiable in logq), KL(p||q) [N] and alpha [N] of a dense kind, from the drafter's
    and the teacher's log-probabilities [N, V] (fp32). With alpha = sum_v min(p_v, q_v) = 1 - TV(p, q):

      kl        -sum_v p_v log q_v                     (the soft CE: KL(p||q) + H(p))
      tv        1 - alpha                              (speculators tv_loss)
      lk        -log(max(alpha, LK_MIN_ALPHA))          (neg_log_acceptance_loss)
      lk_hybrid lam KL(p||q) + (1 - lam)(1 - alpha), lam = exp(-LK_HYBRID_ETA sg[alpha])  (lk_hybrid_loss)
      rkl       KL(q||p) = sum_v q_v (log q_v - log p_v) (reverse_kl_div_loss)
      jsd       (KL(p||m) + KL(q||m)) / 2, m = (p + q) / 2 (js_div_loss)
    """
    p, q = logp.exp(), logq.exp()
    alpha = torch.minimum(p, q).sum(-1)
    kl = (p * (logp - logq)).sum(-1)
    if kind == "kl":
        per_row = -(p * logq).sum(-1)
    elif kind == "tv":
        per_row = 1 - alpha
    elif kind == "lk":
        per_row = -alpha.clamp_min(LK_MIN_ALPHA).log()
    elif kind == "lk_hybrid":
        lam = torch.exp(-LK_HYBRID_ETA * alpha.detach())
        per_row = lam * kl + (1 - lam) * (1 - alpha)
    elif kind == "rkl":
        per_row = (q * (logq - logp)).sum(-1)
    else:
        logm = torch.logaddexp(logq, logp) - math.log(2.0)
        per_row = 0.5 * ((p * (logp - logm)).sum(-1) + (q * (logq - logm)).sum(-1))
    return per_row, kl.detach(), alpha.detach()


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
    """Drafter norm + lm_head + loss against the teacher (spec.md §5), materialised logits.

    h: [N, H] drafter pre-norm states; norm_weight: [H]; lm_head_weight: [V, H] (frozen
    unless it requires grad); weights: [N] = position weight x mask (0 drops a row);
    loss = sum_n w[n] * l[n] / max(normalizer, 1) with w = weights, or with D-PACE
    (`dpace` given) w = weights * dpace_weights(exp(-CE against teacher_argmax), weights > 0).
    kind (teacher: `Teacher`):
      kl      -- soft CE against softmax(lm_head(final_norm(last)))[index]; needs last,
                 final_norm_weight (and index when last is not row for row).
      ce      -- hard CE against teacher.labels [N] (stored teacher argmax) if given, else
                 against argmax(lm_head(final_norm(last)))[index].
      ce_data -- hard CE against teacher.labels [N] (the dataset tokens).
      kl_topk -- soft CE against the stored top-k teacher: p_i = exp(topk_logits - topk_lse)
                 over topk_ids [N, k] plus the rest mass 1 - sum p_i on "every other token".
    markov (DSpark, spec.md §8): the drafter logits are lm_head(norm(h)) + markov.w2 @ markov.e (`Markov`).
      tv, lk, lk_hybrid, rkl, jsd -- against p = softmax(t) as kl (`dense_row_losses`).
    alpha: see `LossOutput`. topk > 0: also each row's top-`topk` drafter ids (`LossOutput.topk_ids`).
    """
    check_loss_inputs(h, norm_weight, lm_head_weight, weights, kind, teacher, dpace, markov)
    logits = F.linear(rms_norm(h, norm_weight, eps), lm_head_weight)
    if markov is not None:
        logits = logits + F.linear(markov.e, markov.w2)
    logits = logits.float()  # [N, V]
    logq = torch.log_softmax(logits, dim=-1)
    kl_row = alpha = None
    if needs_last(kind, teacher.labels is not None):
        with torch.no_grad():
            teacher_logits = F.linear(rms_norm(teacher.last, teacher.final_norm_weight, eps), lm_head_weight).float()
            if teacher.index is not None:
                teacher_logits = teacher_logits[teacher.index]  # [N, V]
        teacher_argmax = teacher_logits.argmax(-1)
        if kind in DENSE_KINDS:
            per_row, kl_row, alpha = dense_row_losses(kind, logq, torch.log_softmax(teacher_logits, dim=-1))
        else:
            per_row = -logq.gather(1, teacher_argmax[:, None])[:, 0]
    elif kind in ("ce", "ce_data"):
        teacher_argmax = teacher.labels.long()
        per_row = -logq.gather(1, teacher_argmax.clamp(0, logits.shape[1] - 1)[:, None])[:, 0]
    else:
        ids = teacher.topk_ids.long()
        teacher_argmax = ids[:, 0]
        p = torch.exp(teacher.topk_logits.float() - teacher.topk_lse.float()[:, None])  # [N, k]
        # With k = V no token is left outside the ids: what 1 - sum p_i leaves is rounding, not mass.
        p_rest = (1 - p.sum(-1)).clamp(min=0) if ids.shape[1] < logits.shape[1] else torch.zeros_like(p[:, 0])
        logq_top = logq.gather(1, ids)
        rest_logits = logits.scatter(1, ids, float("-inf"))
        logq_rest = torch.logsumexp(rest_logits, dim=-1) - torch.logsumexp(logits, dim=-1)
        rest_term = torch.where(p_rest > 0, p_rest * logq_rest, torch.zeros_like(p_rest))
        per_row = -((p * logq_top).sum(-1) + rest_term)
        with torch.no_grad():
            plogp = torch.where(p > 0, p * p.clamp(min=1e-38).log(), torch.zeros_like(p)).sum(-1)
            plogp = plogp + torch.where(p_rest > 0, p_rest * p_rest.clamp(min=1e-38).log(), torch.zeros_like(p_rest))
            kl_row = plogp + per_row.detach()
            alpha = torch.minimum(p, logq_top.exp()).sum(-1) + torch.minimum(p_rest, logq_rest.exp())
    # The drafter's probability of the label: D-PACE's confidence, and alpha against a point-mass teacher.
    label = teacher_argmax.clamp(0, logits.shape[1] - 1)[:, None]
    confidence = logq.detach().gather(1, label)[:, 0].exp()
    alpha = confidence if alpha is None else alpha
    row_weight = weights.float()
    if dpace is not None:
        row_weight = row_weight * dpace_weights(confidence, row_weight > 0, dpace)
    denom = torch.as_tensor(normalizer, dtype=torch.float32, device=h.device).clamp(min=1)
    loss = (per_row * row_weight).sum() / denom
    kl = None if kl_row is None else (kl_row * row_weight).sum() / denom
    top = logits.detach().float().topk(topk, dim=-1) if topk else None
    return LossOutput(loss, kl, logits.argmax(-1), teacher_argmax, alpha,
                      *((top.indices, top.values, torch.logsumexp(logits.detach().float(), -1)) if topk else ()))
