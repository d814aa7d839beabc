"""The DSpark family (spec.md §8): the DFlash backbone plus two heads, a low-rank Markov logit bias from the previous
block token and a confidence head that predicts each slot's acceptance rate; `DSparkDrafter` trains and proposes
with them.

    prev ids [R, A, B] --W1--> e_prev [R, A, B, r]
    vanilla: e = e_prev;  gated: e = sigmoid(G [hidden, e_prev]) * e_prev;
    rnn:     s_0 = 0; z_k = [s_k, e_prev_k, hidden_k]; (g, c, o) = J z_k;
             s_{k+1} = sigmoid(g) s_k + (1 - sigmoid(g)) tanh(c);  e_k = tanh(o)
    bias = W2 e  (never formed here: `e` and W2 go into the fused lm_head loss, losses.Markov)
    confidence logit = proj([hidden, e_prev])  (or proj(hidden))

`hidden` is the drafter's normed block state norm(x), the lm_head's input. Semantics from speculators
0.9.0 `models/dspark/model_definitions.py` (names kept so that its checkpoints and vLLM's loader read
ours: markov_head.markov_w1 [V, r], markov_head.markov_w2 [V, r], gate_proj, joint_proj,
confidence_head.proj).
"""
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from dflash_fast.drafter.backbone import DFlashDrafter, FamilyTerms, Step, _argmax
from dflash_fast.drafter.losses import DENSE_KINDS, LossOutput, Markov
from dflash_fast.drafter.targets import gather_rows, slot_targets


def head_shapes(cfg) -> Dict[str, Tuple[int, ...]]:
    """name -> shape of every parameter of the DSpark heads a DrafterConfig `cfg` asks for (empty for DFlash), from
    the sizes alone (nothing built): what MarkovHead and ConfidenceHead below hold."""
    v, r, h = cfg.vocab_size, cfg.markov_rank, cfg.hidden_size
    shapes = {}
    if r:
        shapes.update({"markov_head.markov_w1.weight": (v, r), "markov_head.markov_w2.weight": (v, r)})
        if cfg.markov_head_type == "gated":
            shapes.update({"markov_head.gate_proj.weight": (r, h + r), "markov_head.gate_proj.bias": (r,)})
        elif cfg.markov_head_type == "rnn":
            shapes.update({"markov_head.joint_proj.weight": (3 * r, 2 * r + h),
                           "markov_head.joint_proj.bias": (3 * r,)})
    if cfg.confidence_head:
        inputs = h + (r if cfg.confidence_head_with_markov else 0)
        shapes.update({"confidence_head.proj.weight": (1, inputs), "confidence_head.proj.bias": (1,)})
    return shapes


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, rank: int, hidden_size: int, head_type: str):
        super().__init__()
        self.head_type, self.rank = head_type, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif head_type == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)  # [gate; candidate; output]

    def reset_parameters(self, std: float):
        nn.init.normal_(self.markov_w1.weight, std=std / 2)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def step(self, e_prev: torch.Tensor, hidden: torch.Tensor, state: Optional[torch.Tensor]):
        """One slot: e_prev [..., r] = W1[prev], hidden [..., H], state [..., r] (rnn; zeros at slot 0)
        -> (e [..., r], the next slot's state [..., r])."""
        if self.head_type == "vanilla":
            return e_prev, state
        if self.head_type == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden, e_prev], dim=-1))) * e_prev, state
        gate, candidate, out = self.joint_proj(torch.cat([state, e_prev, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        return torch.tanh(out), gate * state + (1 - gate) * torch.tanh(candidate)  # e from the state before the update

    def forward(self, prev_ids: torch.Tensor, hidden: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """prev_ids [..., B] (the slots of a block last), hidden [..., B, H] -> (e [..., B, r], the vector W2
        multiplies; e_prev [..., B, r] = W1[prev], the confidence head's Markov feature)."""
        e_prev = self.markov_w1(prev_ids).to(hidden.dtype)
        if self.head_type != "rnn":
            return self.step(e_prev, hidden, None)[0], e_prev
        state = e_prev.new_zeros(*e_prev.shape[:-2], self.rank)
        outputs = []
        for k in range(e_prev.shape[-2]):
            e, state = self.step(e_prev[..., k, :], hidden[..., k, :], state)
            outputs.append(e)
        return torch.stack(outputs, dim=-2), e_prev


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., input_dim] -> logit of the acceptance rate [...]."""
        return self.proj(features).squeeze(-1)


def confidence_terms(
    confidence_logit: torch.Tensor, alpha: torch.Tensor, decay: torch.Tensor, slot_mask: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """DSpark's confidence head (spec.md §8) on confidence logits [R*A*B]: its BCE against the acceptance rate alpha
    [R*A*B], weighted with the decay [R, A, B] over the trained slots (slot_mask [R, A, B]), and its probability
    [R, A, B] (no gradient)."""
    logit = confidence_logit.float()
    bce = F.binary_cross_entropy_with_logits(logit, alpha, reduction="none")
    confidence_loss = (bce * decay.reshape(-1)).sum() / slot_mask.sum().clamp(min=1)
    return confidence_loss, torch.sigmoid(logit.detach()).view(slot_mask.shape)


class DSparkDrafter(DFlashDrafter):
    """DSpark: the backbone plus markov_head (markov_rank > 0) and confidence_head (model.confidence_head)."""

    family = "dspark"

    def add_heads(self) -> None:
        cfg, h = self.config, self.config.hidden_size
        self.markov_head = (
            MarkovHead(cfg.vocab_size, cfg.markov_rank, h, cfg.markov_head_type) if cfg.markov_rank else None
        )
        self.confidence_head = (
            ConfidenceHead(h + (cfg.markov_rank if cfg.confidence_head_with_markov else 0))
            if cfg.confidence_head
            else None
        )

    def reset_parameters(self, std: float = 0.02):
        super().reset_parameters(std)
        if self.markov_head is not None:
            self.markov_head.reset_parameters(std)

    def loss_head(self, step: Step) -> Tuple[Dict[str, Any], Any]:
        """The Markov bias rides in the lm_head loss (losses.Markov); the confidence logits wait for the acceptance
        rate the loss returns."""
        if self.confidence_head is not None and step.loss_kind not in DENSE_KINDS:
            raise ValueError(
                f"the confidence head learns the acceptance rate sum_v min(q_v, p_v) against the full teacher: loss "
                f"kind {step.loss_kind!r} has none; use one of {DENSE_KINDS} (a store with `last`)"
            )
        markov, confidence_logit = self.dspark_heads(step.x, step.prev_ids)
        return {"markov": markov}, confidence_logit

    def family_terms(self, step: Step, out: LossOutput, teacher_argmax: torch.Tensor, state: Any,  # noqa: ARG002
                     weights: Dict[str, float]) -> FamilyTerms:
        """loss += confidence_alpha x the confidence head's BCE against the acceptance rate, weighted with the decay
        whatever the weighting is."""
        if state is None:
            return FamilyTerms(None, out.draft_argmax, {})
        confidence_loss, confidence = confidence_terms(state, out.alpha, step.decay, step.targets.slot_mask)
        return FamilyTerms(weights.get("confidence_alpha", 1.0) * confidence_loss, out.draft_argmax,
                           {"confidence_loss": confidence_loss, "confidence": confidence})

    def dspark_heads(self, x: torch.Tensor, prev_ids: torch.Tensor) -> Tuple[Optional[Markov], Optional[torch.Tensor]]:
        """DSpark's heads on pre-norm block states x [R, A*B, H] with the previous tokens prev_ids [R*A*B]
        (Targets.prev_position's) -> (the Markov bias as the loss takes it, or None; confidence logits [R*A*B]
        or None). Both heads read the lm_head's input norm(x)."""
        if self.markov_head is None and self.confidence_head is None:
            return None, None
        r, b = x.shape[0], self.config.block_size
        hidden = self.norm(x).view(r, -1, b, x.shape[-1])
        markov, feature = None, None
        if self.markov_head is not None:
            e, feature = self.markov_head(prev_ids.view(hidden.shape[:-1]), hidden)
            markov = Markov(e.reshape(-1, e.shape[-1]).to(x.dtype), self.markov_head.markov_w2.weight.to(x.dtype))
        if self.confidence_head is None:
            return markov, None
        features = torch.cat([hidden, feature], dim=-1) if self.config.confidence_head_with_markov else hidden
        return markov, self.confidence_head(features).reshape(-1)

    def logits_with_heads(self, batch: Dict[str, torch.Tensor], x: torch.Tensor,
                          logits: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The Markov bias from the ground-truth previous tokens added, and the confidence logits."""
        targets = slot_targets(batch, self.config.block_size, self.config.sample_from_anchor)
        markov, confidence = self.dspark_heads(x, gather_rows(batch["input_ids"], targets.prev_position))
        if markov is not None:
            logits = logits + F.linear(markov.e, markov.w2).view(logits.shape)
        return logits, confidence

    def walk(self, x: torch.Tensor, hidden: torch.Tensor, logits: torch.Tensor, anchor_token: int, draw=None,
             with_confidence: bool = False,
             context: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:  # noqa: ARG002
        """With a Markov head the block is drafted slot by slot, each slot's bias from the token drafted for the
        position before its own (the anchor's token first), each token picked through `draw`; the confidence head's
        acceptance probability of each guess when asked."""
        first = self.config.first_slot
        features = hidden[first:]
        if self.markov_head is None:
            guesses, _ = super().walk(x, hidden, logits, anchor_token, draw)
        else:
            draw = draw or _argmax
            head, shift = self.markov_head, int(self.config.sample_from_anchor)
            tokens = [torch.tensor(anchor_token, device=logits.device)]  # tokens[m]: the token at position T + m
            state, e_prevs = hidden.new_zeros(head.rank), []
            for k in range(self.config.block_size):
                e_prev = head.markov_w1(tokens[max(k + shift - 1, 0)]).to(x.dtype)
                e, state = head.step(e_prev, hidden[k], state)
                if k >= first:
                    tokens.append(draw((logits[k] + head.markov_w2(e))[None])[0])
                    e_prevs.append(e_prev)
            guesses = torch.stack(tokens[1:])
            if self.config.confidence_head_with_markov:
                features = torch.cat([features, torch.stack(e_prevs)], dim=-1)
        if not with_confidence:
            return guesses, None
        return guesses, torch.sigmoid(self.confidence_head(features).float())

    @property
    def proposes_confidence(self) -> bool:
        return self.confidence_head is not None
