"""The DFlash2 family (spec.md §9): the DFlash backbone plus grouped dynamic causal convolutions inside each draft
block around both sublayers of every decoder layer (conv.py: they live in the backbone's decoder layer), and the
low-rank candidate selector that re-ranks each slot's unary top-K with the previous token; `DFlash2Drafter` trains
and proposes with the selector.

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
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from dflash_fast.drafter import ops
from dflash_fast.drafter.backbone import DFlashDrafter, FamilyTerms, Step
from dflash_fast.drafter.conv import DynamicConv
from dflash_fast.drafter.losses import DPace, LossOutput, dpace_weights
from dflash_fast.drafter.targets import gather_rows, slot_targets

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


class DFlash2Drafter(DFlashDrafter):
    """DFlash2: the backbone with its convolutions (in the layers, conv_kernel_size > 0) plus candidate_selector
    (selector_rank > 0)."""

    family = "dflash2"

    def add_heads(self) -> None:
        cfg = self.config
        self.candidate_selector = (
            CandidateSelector(cfg.vocab_size, cfg.hidden_size, cfg.selector_rank, cfg.selector_top_k)
            if cfg.selector_rank else None
        )

    def reset_parameters(self, std: float = 0.02):
        super().reset_parameters(std)
        for m in self.modules():
            if isinstance(m, DynamicConv):
                m.reset_parameters()  # identity: a fresh DFlash2 is DFlash
        if self.candidate_selector is not None:
            self.candidate_selector.reset_parameters(std)

    def loss_head(self, step: Step) -> Tuple[Dict[str, Any], Any]:  # noqa: ARG002 (the step is family_terms')
        """The fused lm_head pass also returns each slot's unary top-K, the selector's candidates."""
        return ({"topk": self.candidate_selector.top_k} if self.candidate_selector is not None else {}), None

    def family_terms(self, step: Step, out: LossOutput, teacher_argmax: torch.Tensor, state: Any,  # noqa: ARG002
                     weights: Dict[str, float]) -> FamilyTerms:
        """loss += selector_alpha x the selector's K-way CE against the teacher argmax (`selector_loss`), weighted
        like the main loss; the draft is the selector's pick (spec.md §9): acc_j and tau_offline are the selector's."""
        selector = self.candidate_selector
        if selector is None:
            return FamilyTerms(None, out.draft_argmax, {})
        n, shape = step.weights.shape[0], step.targets.slot_mask.shape
        hidden = ops.rms_norm(step.x.reshape(n, -1), self.norm.weight, self.norm.eps)
        sel = selector_loss(selector, hidden, self.lm_head, step.prev_ids, out.topk_ids, teacher_argmax,
                            step.weights, step.targets.slot_mask.sum(), step.dpace, out.topk_logits)
        return FamilyTerms(weights.get("selector_alpha", 1.0) * sel.loss, sel.draft,
                           {"selector_loss": sel.loss, "recall": sel.recall.view(shape),
                            "selector_hit": sel.hit.view(shape)})

    def gate_outputs(self, batch: Dict[str, torch.Tensor], logits: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The candidate selector's fp32 scores [A*B, K] of the candidates of every slot of the one row of `batch`
        (the unary top-K of `logits`, the trained drafter's), `prev` the ground-truth previous token: what the
        selector walk ranks."""
        if self.candidate_selector is None:
            return {}
        ids = logits[0, :, : self.config.vocab_size].topk(self.config.selector_top_k).indices
        x = self.batch_states(batch)
        targets = slot_targets(batch, self.config.block_size, self.config.sample_from_anchor)
        prev = gather_rows(batch["input_ids"], targets.prev_position)
        hidden = self.norm(x).reshape(ids.shape[0], -1)
        return {"candidate selector scores": self.candidate_selector.scores(hidden, self.lm_head, prev, ids)}

    def walk(self, x: torch.Tensor, hidden: torch.Tensor, logits: torch.Tensor, anchor_token: int, draw=None,
             with_confidence: bool = False,
             context: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:  # noqa: ARG002
        """With the selector, greedy without a draw takes the best score, not the argmax of a row
        (`selector_walk`)."""
        if self.candidate_selector is None:
            return super().walk(x, hidden, logits, anchor_token, draw, with_confidence)
        return self.selector_walk(hidden, logits, anchor_token, draw), None

    def selector_walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_token: int, draw=None) -> torch.Tensor:
        """spec.md §9 inference of one block: hidden [B, H] (norm(x)), unary logits [B, V] -> the drafted tokens
        [drafted_tokens]. Slot by slot over the slot's unary top-K, `prev` being the token drafted for the position
        before the slot's own (the anchor's token for the first slot): greedy takes the best score; `draw` (logits
        [1, V] -> token [1]) is handed the scores at the K candidates' ids and -inf elsewhere, vLLM's cached
        draft logits (spec_decode/dflash2 `_cache_draft_logits_kernel`), so a DraftSampler draws from and records
        q = softmax(score / T) over the K candidates, and the next slot's prev is the token it drew."""
        selector, shift = self.candidate_selector, int(self.config.sample_from_anchor)
        tokens = [torch.tensor(anchor_token, device=logits.device)]  # tokens[m]: the token at position T + m
        for k in range(self.config.first_slot, self.config.block_size):
            ids = logits[k].topk(selector.top_k).indices[None]  # [1, K]
            scores = selector.scores(hidden[k][None], self.lm_head, tokens[k + shift - 1][None], ids)
            if draw is None:
                tokens.append(ids[0, scores[0].argmax()])
            else:
                candidate_logits = scores.new_full((1, logits.shape[-1]), float("-inf")).scatter(1, ids, scores)
                tokens.append(draw(candidate_logits)[0])
        return torch.stack(tokens[1:])
