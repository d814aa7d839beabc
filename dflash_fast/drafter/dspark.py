"""DSpark's two heads on the DFlash backbone (spec.md §8): a low-rank Markov logit bias from the previous
block token, and a confidence head that predicts each slot's acceptance rate.

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
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


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
