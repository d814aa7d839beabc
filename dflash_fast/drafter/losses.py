"""The loss vocabulary every side of the loss shares (spec.md §5, §8): the kinds and weightings, which kinds read
the full teacher, and the types the eager twin and the kernel both take and return (Teacher, DPace, Markov,
LossOutput), with their checks and the D-PACE weights. The eager twin (`eager.lm_head_loss`) and the Triton kernel
(`dflash_fast/kernels/lm_head_loss.py`) import this module; neither imports the other.
"""

from typing import NamedTuple, Optional

import torch

# The kinds scored against the full teacher distribution p = softmax(lm_head(final_norm(last))): the soft
# cross-entropy, and the divergences speculators 0.9.0 trains with (losses/eager.py): total variation, negative
# log-acceptance "LK", LK-hybrid (arXiv 2602.23881), reverse KL, Jensen-Shannon.
DENSE_KINDS = ("kl", "tv", "lk", "lk_hybrid", "rkl", "jsd")


LOSS_KINDS = ("kl", "ce", "ce_data", "kl_topk", "tv", "lk", "lk_hybrid", "rkl", "jsd")


WEIGHTINGS = ("decay", "dpace")


LK_MIN_ALPHA = 1e-5  # lk: -log(max(alpha, LK_MIN_ALPHA)); no gradient below it (speculators' clamp)


LK_HYBRID_ETA = 3.0  # lk_hybrid: lambda = exp(-eta sg[alpha]), the paper's best setting


def has_kl(kind: str) -> bool:
    """The loss kind has a soft teacher, so KL(p||q) is a metric: kl_topk and every dense kind."""
    return kind == "kl_topk" or kind in DENSE_KINDS


def needs_last(kind: str, stored_labels: bool) -> bool:
    """The loss kind scores against the full teacher lm_head(final_norm(last)): the dense kinds, and ce without
    stored labels."""
    return kind in DENSE_KINDS or (kind == "ce" and not stored_labels)


class Teacher(NamedTuple):
    """The teacher side of the loss (spec.md §5); which fields a kind reads is in `lm_head_loss`.

    last: [U, H] the target's pre-norm final states at the teacher positions; final_norm_weight: [H]
    (effective weight); index: [N] int64, the row of `last` that drafter row n is scored against (its
    position p - 1), None when `last` is [N, H] row for row. Overlapping blocks share teacher positions,
    so U can be much smaller than N: the teacher logits are computed once per row of `last`.
    labels: [N]; topk_ids, topk_logits: [N, k]; topk_lse: [N].
    """

    last: Optional[torch.Tensor] = None
    final_norm_weight: Optional[torch.Tensor] = None
    index: Optional[torch.Tensor] = None
    labels: Optional[torch.Tensor] = None
    topk_ids: Optional[torch.Tensor] = None
    topk_logits: Optional[torch.Tensor] = None
    topk_lse: Optional[torch.Tensor] = None


class DPace(NamedTuple):
    """D-PACE position weights (spec.md §5) over blocks of `block_size` consecutive rows; alpha in [0, 1]."""

    alpha: float
    block_size: int


class Markov(NamedTuple):
    """The DSpark Markov bias (spec.md §8) as a rank-r extension of the lm_head GEMM: the drafter logits of row n
    are lm_head(norm(h_n)) + w2 @ e_n, i.e. [norm(h_n), e_n] against [lm_head, w2].

    e: [N, r] the row's rank-r vector (vanilla: W1[prev]; gated, rnn: their transform of it), in h.dtype;
    w2: [V, r] in h.dtype. Both receive gradients through the loss."""

    e: torch.Tensor
    w2: torch.Tensor


class LossOutput(NamedTuple):
    """loss: scalar (differentiable); kl: scalar KL(p||q) metric for the kinds with a soft teacher (`has_kl`),
    else None; draft_argmax, teacher_argmax: [N] int64 (teacher_argmax is the label the loss used);
    alpha: [N] fp32, no gradient, every row (masked ones too): the acceptance estimate of each row, the
    overlap sum_v min(p_v, q_v) = 1 - TV(p, q) of the drafter's q = softmax(s) with the teacher p the kind
    scores against: softmax(t) for the dense kinds, the point mass at the label for ce and ce_data (alpha =
    q_label, D-PACE's confidence), the stored top-k ids plus one "every other token" bucket for kl_topk.
    topk_ids: [N, K] int64, no gradient: each row's K best drafter logits, best first (asked with `topk = K`: the
    DFlash2 selector's candidates, spec.md §9), else None; topk_logits: [N, K] fp32, no gradient, their logits; lse:
    [N] fp32, no gradient, with topk: each row's log-sum-exp of the drafter logits (topk_logits - lse: the
    candidates' raw log-softmax, LiLiCorr's features)."""

    loss: torch.Tensor
    kl: Optional[torch.Tensor]
    draft_argmax: torch.Tensor
    teacher_argmax: torch.Tensor
    alpha: torch.Tensor
    topk_ids: Optional[torch.Tensor] = None
    topk_logits: Optional[torch.Tensor] = None
    lse: Optional[torch.Tensor] = None


def dpace_weights(confidence: torch.Tensor, mask: torch.Tensor, dpace: DPace) -> torch.Tensor:
    """D-PACE weights [N] fp32 of rows in blocks of dpace.block_size; confidence, mask: [N].

    Per block, c_j = confidence (exp(-CE_j) against the loss's label), m_j = mask (trained slots):
    s_j = (1 - alpha) c_j + alpha where m_j, else 1; P_j = prod_{i <= j} s_i; w_j = m_j sum_{i >= j} P_i m_i.
    """
    c = confidence.detach().float().view(-1, dpace.block_size)
    m = mask.view(-1, dpace.block_size).float()
    smooth = torch.where(m > 0, (1 - dpace.alpha) * c + dpace.alpha, torch.ones_like(c))
    reach = torch.cumprod(smooth, dim=-1) * m
    return (reach.flip(-1).cumsum(-1).flip(-1) * m).view(-1)


def check_loss_inputs(
    h: torch.Tensor,
    norm_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    weights: torch.Tensor,
    kind: str,
    teacher: Teacher,
    dpace: Optional[DPace],
    markov: Optional[Markov] = None,
) -> None:
    """Shapes, dtypes and the inputs each kind needs, for the eager loss and the kernel alike."""
    n, hid = h.shape if h.dim() == 2 else (None, None)
    if kind not in LOSS_KINDS:
        raise ValueError(f"loss kind {kind!r} is not one of {LOSS_KINDS}")
    if markov is not None and (
        markov.e.dim() != 2 or markov.e.shape[0] != h.shape[0] or markov.w2.dim() != 2
        or markov.w2.shape != (lm_head_weight.shape[0], markov.e.shape[1])
        or markov.e.dtype != h.dtype or markov.w2.dtype != h.dtype
    ):
        raise ValueError(
            f"markov.e must be [N, r] and markov.w2 [V, r] in {h.dtype} (N = {h.shape[0]}, V = "
            f"{lm_head_weight.shape[0]}); got {tuple(markov.e.shape)} {markov.e.dtype} and "
            f"{tuple(markov.w2.shape)} {markov.w2.dtype}"
        )
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
    if dpace is not None and (n % dpace.block_size or not 0 <= dpace.alpha <= 1):
        raise ValueError(
            f"D-PACE needs N = {n} rows in whole blocks of {dpace.block_size} and alpha = {dpace.alpha} in [0, 1]"
        )
    if needs_last(kind, teacher.labels is not None):
        if teacher.last is None or teacher.final_norm_weight is None:
            raise ValueError(f"loss kind {kind!r} without stored labels needs teacher.last and final_norm_weight")
        if teacher.last.dim() != 2 or teacher.last.shape[1] != hid or teacher.last.dtype != h.dtype:
            raise ValueError(
                f"teacher.last must be [U, {hid}] in {h.dtype}; got {tuple(teacher.last.shape)}, {teacher.last.dtype}"
            )
        if teacher.index is None and teacher.last.shape[0] != n:
            raise ValueError(f"teacher.last has {teacher.last.shape[0]} rows for N = {n}: pass teacher.index [N]")
        if teacher.index is not None and (teacher.index.shape != (n,) or teacher.index.is_floating_point()):
            raise ValueError(
                f"teacher.index must be [N] = [{n}] integers; got {tuple(teacher.index.shape)} {teacher.index.dtype}"
            )
    elif kind in ("ce", "ce_data"):
        if teacher.labels is None:
            raise ValueError(f"loss kind {kind!r} needs teacher.labels")
        if teacher.labels.shape != (n,):
            raise ValueError(f"teacher.labels must be [N] = [{n}]; got {tuple(teacher.labels.shape)}")
    elif teacher.topk_ids is None or teacher.topk_logits is None or teacher.topk_lse is None:
        raise ValueError("loss kind 'kl_topk' needs teacher.topk_ids, topk_logits and topk_lse")
    elif (teacher.topk_ids.dim() != 2 or teacher.topk_ids.shape[0] != n
          or teacher.topk_logits.shape != teacher.topk_ids.shape):
        raise ValueError(
            f"teacher.topk_ids and topk_logits must be [N, k] with N = {n}; got {tuple(teacher.topk_ids.shape)}, "
            f"{tuple(teacher.topk_logits.shape)}"
        )
