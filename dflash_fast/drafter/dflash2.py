"""DFlash2's two additions to the DFlash backbone (spec.md §9): grouped dynamic causal convolutions inside each draft
block around both sublayers of every decoder layer, and the low-rank candidate selector that re-ranks each slot's
unary top-K with the previous token.

    convolution (per sublayer): x -> norm -> conv_in -> attention | MLP -> conv_out -> + residual (one op: `finish`)
        delta = kernel_projection(norm(x)) [.., S, 2, taps, G]  (G = H / group groups, one coefficient each)
        y_s[c] = sum_{t < taps, t <= s} x_{s-t}[c] * (base[t, c] + delta_s[t, g(c)])   (s: slot in its block)
        conv_in uses base_kernel[0] and delta[.., 0]; conv_out base_kernel[1] and delta[.., 1] (from the input)
    selector: score(c) = unary_logit(c) + sum_r (P[prev] * W_h hidden)_r S[c]_r  over the unary top-K candidates c
        hidden = norm(x), the lm_head's input; P, S: [V, r] codebooks; W_h: [r, H]

Semantics from speculators 0.9.0 `models/dflash2/` (model_definitions.py grouped_dynamic_conv,
GroupedDynamicCausalConv, Qwen3DFlash2DecoderLayer, CandidateSelector; metrics.py selector_training_candidates,
compute_selector_loss, compute_metrics). Parameter names are speculators' (attention_conv / mlp_conv .base_kernel,
.kernel_projection.weight; candidate_selector.predecessor_codebook, .successor_codebook, .hidden_projection.weight),
so that its checkpoints and vLLM's loader can read ours.
"""
from typing import Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from dflash_fast.drafter import ops
from dflash_fast.drafter.losses import DPace, dpace_weights

CONV_NAMES = ("attention_conv", "mlp_conv")


def head_shapes(cfg) -> Dict[str, Tuple[int, ...]]:
    """name -> shape of every DFlash2 parameter a DrafterConfig `cfg` asks for (empty for DFlash and DSpark), from
    the sizes alone (nothing built): what DynamicConv and CandidateSelector below hold."""
    h, taps, rank = cfg.hidden_size, cfg.conv_kernel_size, cfg.selector_rank
    shapes = {}
    if taps:
        groups = h // cfg.conv_group_size
        for n in range(cfg.num_layers):
            for conv in CONV_NAMES:
                shapes[f"layers.{n}.{conv}.base_kernel"] = (2, taps, h)
                shapes[f"layers.{n}.{conv}.kernel_projection.weight"] = (2 * taps * groups, h)
    if rank:
        shapes.update({
            "candidate_selector.predecessor_codebook": (cfg.vocab_size, rank),
            "candidate_selector.successor_codebook": (cfg.vocab_size, rank),
            "candidate_selector.hidden_projection.weight": (rank, h),
        })
    return shapes


def grouped_dynamic_conv(
    x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int, group_size: int,
    residual: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The causal convolution inside each block: x [R, A*B, H] (the A blocks of B slots one after another),
    delta [R, A*B, taps, G] (each output slot's dynamic coefficients, G = H / group_size), base [taps, H]
    -> y [R, A*B, H] with y_s = sum_{t <= s} x_{s-t} * (base[t] + delta_s[t, group]); taps never reach into the
    block before. With residual [R, A*B, H]: residual + y (the decoder layer's residual add, which the kernel fuses
    into its one write)."""
    r, q, h = x.shape
    taps, groups = base.shape[0], h // group_size
    xb = x.view(r, q // block_size, block_size, groups, group_size)
    db = delta.view(r, q // block_size, block_size, taps, groups)
    y = torch.zeros_like(xb)
    for t in range(taps):
        shifted = F.pad(xb[:, :, : block_size - t], (0, 0, 0, 0, t, 0))  # x_{s-t}, zeros for s < t
        y = y + shifted * (base[t].to(x.dtype).view(groups, group_size) + db[:, :, :, t, :, None])
    return y.view(r, q, h) if residual is None else residual + y.view(r, q, h)


def projected_conv(
    x: torch.Tensor, weight: torch.Tensor, base: torch.Tensor, block_size: int, group_size: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The kernel projection and conv_in of one sublayer: x [R, A*B, H] (its normed input), weight [2 taps G, H],
    base [taps, H] (conv_in's) -> (conv_in(x) [R, A*B, H], conv_out's delta [R, A*B, taps, G]), the projection's
    output delta = x W^T viewed [R, A*B, 2, taps, G] (index 0 conv_in's, 1 conv_out's)."""
    delta = F.linear(x, weight).view(*x.shape[:-1], 2, base.shape[0], x.shape[-1] // group_size)
    y = grouped_dynamic_conv(x, delta[..., 0, :, :], base, block_size, group_size)
    return y, delta[..., 1, :, :]


def conv_impl():
    """The convolution the ops backend `grouped_dynamic_conv` selects: kernels/grouped_dynamic_conv.py (one pass
    each way) or `grouped_dynamic_conv` above, its eager twin."""
    return ops.kernel_or("grouped_dynamic_conv", grouped_dynamic_conv)


def projected_conv_impl():
    """`projected_conv` on the same switch: the kernel module's (conv_in's dx and the projection's dgrad summed by
    one in-place addmm) or the one above."""
    return ops.kernel_or("grouped_dynamic_conv", projected_conv, name="projected_conv")


class DynamicConv(nn.Module):
    """The input- and output-side convolutions of one sublayer, both driven by one projection of its normed input."""

    def __init__(self, hidden_size: int, block_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.block_size, self.kernel_size, self.group_size = block_size, kernel_size, group_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Identity (base[0] = 1, the other taps and the projection 0): a fresh DFlash2 layer is a DFlash layer."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """x [R, A*B, H] (normed sublayer input) -> (conv_in(x) [R, A*B, H], the output side's delta
        [R, A*B, taps, G])."""
        return projected_conv_impl()(x, self.kernel_projection.weight, self.base_kernel[0], self.block_size,
                                     self.group_size)

    def finish(self, y: torch.Tensor, delta: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual [R, A*B, H] + the sublayer's output y [R, A*B, H] through conv_out with the delta `prepare`
        computed: the decoder layer's residual add inside the convolution (the kernel writes the sum once)."""
        return conv_impl()(y, delta, self.base_kernel[1], self.block_size, self.group_size, residual)


class CandidateSelector(nn.Module):
    """The bilinear re-ranker of a slot's unary top-K: transition(c) = sum_r (P[prev] * W_h hidden)_r S[c]_r."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for p in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(p, std=std)

    def transition(self, hidden: torch.Tensor, prev_ids: torch.Tensor, candidate_ids: torch.Tensor) -> torch.Tensor:
        """hidden [N, H], prev_ids [N], candidate_ids [N, K] -> the transition scores [N, K]."""
        predecessor = self.predecessor_codebook[prev_ids]
        context = predecessor * self.hidden_projection(hidden).to(predecessor.dtype)
        return torch.einsum("nr,nkr->nk", context, self.successor_codebook[candidate_ids])

    def scores(self, hidden: torch.Tensor, lm_head: torch.Tensor, prev_ids: torch.Tensor,
               candidate_ids: torch.Tensor, unary: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The candidates' scores [N, K] fp32: their unary logits hidden . lm_head[c] (from the K gathered lm_head
        rows only, never [N, V]) plus the transition. hidden [N, H]; lm_head [V, H]; prev_ids [N]; ids [N, K].
        unary [N, K] fp32 (no gradient): those logits as the fused lm_head pass computed them (`candidate_unary`:
        no [N, K, H] gather forward, none backward)."""
        if unary is None:
            unary = torch.einsum("nh,nkh->nk", hidden, lm_head[candidate_ids].to(hidden.dtype))
        else:
            unary = candidate_unary(hidden, lm_head, candidate_ids, unary)
        return unary.float() + self.transition(hidden, prev_ids, candidate_ids).float()


class CandidateUnary(torch.autograd.Function):
    """unary[n, k] = hidden[n] . lm_head[ids[n, k]], its value given (the fused lm_head pass's logits of the ids);
    backward: d hidden[n] = sum_k g[n, k] lm_head[ids[n, k]] by one embedding_bag (the K rows read, no [N, K, H]
    tensor), and for a trained lm_head d lm_head[ids[n, k]] += g[n, k] hidden[n]. The eager twin is the einsum of
    `CandidateSelector.scores` over the gathered rows."""

    @staticmethod
    def forward(ctx, hidden, lm_head, ids, unary):
        ctx.save_for_backward(hidden, lm_head, ids)
        return unary.float()

    @staticmethod
    def backward(ctx, grad):
        hidden, lm_head, ids = ctx.saved_tensors
        grad_hidden = grad_head = None
        if ctx.needs_input_grad[0]:
            grad_hidden = F.embedding_bag(ids, lm_head, per_sample_weights=grad.to(lm_head.dtype),
                                          mode="sum").to(hidden.dtype)
        if ctx.needs_input_grad[1]:
            rows = (grad[:, :, None] * hidden[:, None, :].float()).flatten(0, 1)
            grad_head = torch.zeros_like(lm_head, dtype=torch.float32).index_add_(0, ids.flatten(), rows)
            grad_head = grad_head.to(lm_head.dtype)
        return grad_hidden, grad_head, None, None


def candidate_unary(hidden: torch.Tensor, lm_head: torch.Tensor, ids: torch.Tensor,
                    unary: torch.Tensor) -> torch.Tensor:
    """hidden [N, H], lm_head [V, H], ids [N, K], unary [N, K] (hidden . lm_head[ids], computed) -> unary [N, K] fp32
    with the gradient of hidden . lm_head[ids] (CandidateUnary)."""
    return CandidateUnary.apply(hidden, lm_head, ids, unary.detach())


def training_candidates(topk_ids: torch.Tensor, label: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The selector's training candidates (spec.md §9): topk_ids [N, K] (unary top-K, best first), label [N] (the
    teacher argmax) -> (candidate ids [N, K]: the top-K with the label in the K-th place when it is not among them,
    the label's index [N], contains [N] bool: the label was in the unary top-K)."""
    k = topk_ids.shape[1]
    hit = topk_ids == label[:, None]
    contains = hit.any(-1)
    index = torch.where(contains, hit.long().argmax(-1), torch.full_like(label, k - 1))
    ids = topk_ids.clone()
    ids[:, -1] = torch.where(contains, ids[:, -1], label)
    return ids, index, contains


class SelectorOutput(NamedTuple):
    """loss: the selector's K-way CE, weighted and normalised like the main loss; recall [N] bool: the label is in
    the unary top-K; hit [N] bool: with it there, the selector's best candidate is the label (teacher-forced);
    draft [N] int64: the token the selector drafts from the unary top-K (no label injected) with the ground-truth
    previous token, what greedy inference drafts while the block's earlier drafts were right."""

    loss: torch.Tensor
    recall: torch.Tensor
    hit: torch.Tensor
    draft: torch.Tensor


def selector_loss(
    selector: CandidateSelector,
    hidden: torch.Tensor,
    lm_head: torch.Tensor,
    prev_ids: torch.Tensor,
    topk_ids: torch.Tensor,
    label: torch.Tensor,
    weights: torch.Tensor,
    normalizer: torch.Tensor,
    dpace: Optional[DPace] = None,
    topk_logits: Optional[torch.Tensor] = None,
) -> SelectorOutput:
    """The selector's loss on N slots: hidden [N, H] (norm(x)), lm_head [V, H], prev_ids [N], unary topk_ids [N, K],
    label [N] (the teacher argmax), weights [N] (decay x mask, or the mask under D-PACE), normalizer (the trained
    slot count). Under D-PACE (speculators' compute_selector_loss) the weights come from the selector's own
    confidence exp(-CE_j) on its K candidates. topk_logits [N, K] fp32 (the lm_head loss's, no gradient): the
    candidates' unary logits taken from it (the injected label's from its one lm_head row), not from K gathered
    rows; equal up to rounding, the same gradients."""
    ids, index, contains = training_candidates(topk_ids, label)
    unary = None
    if topk_logits is not None:
        with torch.no_grad():
            label_logit = torch.einsum("nh,nh->n", hidden, lm_head[label].to(hidden.dtype)).float()
            unary = topk_logits.float().clone()
            unary[:, -1] = torch.where(contains, unary[:, -1], label_logit)
    scores = selector.scores(hidden, lm_head, prev_ids, ids, unary)
    ce = F.cross_entropy(scores, index, reduction="none")
    w = weights.float()
    if dpace is not None:
        w = w * dpace_weights(torch.exp(-ce.detach()), w > 0, dpace)
    loss = (ce * w).sum() / normalizer.float().clamp(min=1)
    with torch.no_grad():
        hit = contains & (scores.argmax(-1) == index)
        serving = scores.clone()  # the unary top-K's scores: the K-th candidate's where the label replaced it
        replaced = selector.scores(hidden, lm_head, prev_ids, topk_ids[:, -1:],
                                   None if topk_logits is None else topk_logits[:, -1:])[:, 0]
        serving[:, -1] = torch.where(contains, serving[:, -1], replaced)
        draft = topk_ids.gather(1, serving.argmax(-1, keepdim=True))[:, 0]
    return SelectorOutput(loss, contains, hit, draft)
