"""The LiLiCorr family: the candidate-lattice correlator on the DFlash backbone, with or without DFlash2's
convolutions (NVIDIA, arXiv 2608.20530; docs/lilicorr.md); `LiLiCorrDrafter` trains and proposes with it.

The backbone keeps its top-K candidates at each of the B - 1 drafted slots; a small bidirectional transformer runs
over the whole S x K lattice, and every transition between neighbouring slots gets a score. The block is drafted by
walking the lattice greedily (DFlash2's walk: vLLM's `_selector_walk_kernel`); verification is unchanged.

    features(c)  = [log p, p, log p - max_slot log p, rank / (K - 1), rank == 0]   (log p: the raw log-softmax)
    lattice(s, c) = token_proj(E_target[c]) + pass_hidden_proj(h_s) + feature_mlp(LayerNorm(features))
                    + slot_embedding[s] + rank_embedding[c]            -> num_layers pre-norm layers over S*K rows,
                    attention bias relative_slot_bias[head, s_q - s_k + B - 1] + same_slot_bias[head] [s_q == s_k]
    anchor a      = anchor_norm(context_proj(ctx_{anchor - 1}) * valid)      (ctx = hidden_norm(fc(taps)))
    f(s, c)       = silu(factor_input_proj([x, a, x * a])), x = output_norm(lattice(s, c))
    start[j]      = logit_scale cos(anchor_out_head(a), in_head(f(0, j)))
    pair[s, i, j] = logit_scale cos(out_head(f(s, i)), in_head(f(s + 1, j)))
    walk: c_0 = argmax_j start[j]; c_s = argmax_j pair[s - 1, c_{s-1}, j]   (T > 0: a draw from softmax(. / T))

Parameter names are vLLM 0.32's (`model_executor/models/lilicorr.py` LiLiCorrHead: `feature_norm`,
`feature_mlp.up_proj`/`down_proj`, `layers.{i}.attn.in_proj_weight`, ...), so that an export loads there as it is.
The training objective is ModelOpt's (`plugins/hf_lilicorr.py` `_compute_lilicorr_loss`): `lattice_loss`.
"""
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from dflash_fast.drafter import dflash2, ops
from dflash_fast.drafter.backbone import FamilyTerms, Step
from dflash_fast.drafter.dflash2 import DFlash2Drafter
from dflash_fast.drafter.layers import RMSNorm
from dflash_fast.drafter.losses import LossOutput
from dflash_fast.target.norm import rms_norm

NUM_FEATURES = 5


def candidate_features(log_probs: torch.Tensor) -> torch.Tensor:
    """log_probs [..., K] (each slot's candidates, best first) -> the five features [..., K, 5] fp32."""
    lp = log_probs.float()
    k = lp.shape[-1]
    rank = torch.arange(k, device=lp.device, dtype=torch.float32) / max(k - 1, 1)
    top1 = (torch.arange(k, device=lp.device) == 0).float()
    return torch.stack([lp, lp.exp(), lp - lp.max(-1, keepdim=True).values,
                        rank.expand_as(lp), top1.expand_as(lp)], dim=-1)


class LatticeMLP(nn.Module):
    """down_proj(silu(up_proj(x))), both with bias (vLLM's non-gated NemotronHMLP)."""

    def __init__(self, dim_in: int, dim_mid: int, dim_out: int):
        super().__init__()
        self.up_proj = nn.Linear(dim_in, dim_mid)
        self.down_proj = nn.Linear(dim_mid, dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.up_proj(x)))


class LatticeAttention(nn.Module):
    """Unmasked multi-head attention over the lattice rows with a learned additive bias per head."""

    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * hidden_size, hidden_size))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * hidden_size))
        self.out_proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x [N, L, h], bias [heads, L, L] -> [N, L, h]."""
        n, length, h = x.shape
        q, k, v = (t.view(n, length, self.num_heads, -1).transpose(1, 2)
                   for t in F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None].to(x.dtype))
        return self.out_proj(out.transpose(1, 2).reshape(n, length, h))


class LatticeLayer(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float, eps: float):
        super().__init__()
        self.attn_norm = RMSNorm(hidden_size, eps)
        self.attn = LatticeAttention(hidden_size, num_heads)
        self.mlp_norm = RMSNorm(hidden_size, eps)
        self.mlp = LatticeMLP(hidden_size, int(hidden_size * mlp_ratio), hidden_size)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


class LiLiCorrHead(nn.Module):
    """The lattice correlator: `scores` -> (start [N, K], pair [N, S - 1, K, K]) cosines; `walk_scores` -> vLLM's
    [N, S, K, K] walk table. cfg: a DrafterConfig with lilicorr_candidate_topk > 0."""

    def __init__(self, cfg):
        super().__init__()
        model_h = cfg.hidden_size
        h = cfg.lilicorr_hidden_size or model_h
        self.block_size, self.num_slots, self.top_k = cfg.block_size, cfg.block_size - 1, cfg.lilicorr_candidate_topk
        self.hidden_size, self.num_heads, self.factor_dim = h, cfg.lilicorr_num_heads, cfg.lilicorr_factor_dim
        self.vector_eps, self.logit_scale = float(cfg.lilicorr_vector_eps), float(cfg.lilicorr_logit_scale)
        self.eps = eps = cfg.rms_norm_eps
        self.token_proj = nn.Identity() if h == model_h else nn.Linear(model_h, h)
        self.pass_hidden_proj = nn.Linear(model_h, h)
        self.feature_norm = nn.LayerNorm(NUM_FEATURES)
        self.feature_mlp = LatticeMLP(NUM_FEATURES, h, h)
        self.slot_embedding = nn.Parameter(torch.zeros(1, 1, self.num_slots, 1, h))
        self.rank_embedding = nn.Parameter(torch.zeros(1, 1, 1, self.top_k, h))
        self.relative_slot_bias = nn.Parameter(torch.zeros(self.num_heads, 2 * self.block_size - 1))
        self.same_slot_bias = nn.Parameter(torch.zeros(self.num_heads))
        self.context_proj = nn.Linear(model_h, h)
        self.layers = nn.ModuleList(LatticeLayer(h, self.num_heads, cfg.lilicorr_mlp_ratio, eps)
                                    for _ in range(cfg.lilicorr_num_layers))
        self.output_norm = RMSNorm(h, eps)
        self.anchor_norm = RMSNorm(h, eps)
        self.factor_input_proj = nn.Linear(3 * h, h)
        self.out_head = nn.Linear(h, self.factor_dim)
        self.in_head = nn.Linear(h, self.factor_dim)
        self.anchor_out_head = nn.Linear(h, self.factor_dim)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """ModelOpt's init (modeling_lilicorr.py LiLiCorrModule): Linears N(0, std) with zero bias, the attention's
        in_proj Xavier-uniform with zero bias (nn.MultiheadAttention's), embeddings and slot biases zero."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                nn.init.zeros_(m.bias)
            elif isinstance(m, LatticeAttention):
                nn.init.xavier_uniform_(m.in_proj_weight)
                nn.init.zeros_(m.in_proj_bias)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
        self.feature_norm.reset_parameters()
        for p in (self.slot_embedding, self.rank_embedding, self.relative_slot_bias, self.same_slot_bias):
            nn.init.zeros_(p)

    def attention_bias(self, num_slots: int) -> torch.Tensor:
        """[heads, S*K, S*K]: relative_slot_bias at the trained offset B - 1 (a shorter lattice reads its prefix)
        plus same_slot_bias where the two rows share a slot."""
        slot = torch.arange(num_slots, device=self.same_slot_bias.device).repeat_interleave(self.top_k)
        rel = slot[:, None] - slot[None, :]
        same = (rel == 0).to(self.same_slot_bias.dtype)
        return self.relative_slot_bias[:, rel + self.block_size - 1] + same[None] * self.same_slot_bias[:, None, None]

    def scores(self, token_embeddings: torch.Tensor, log_probs: torch.Tensor, pass_hidden: torch.Tensor,
               anchor_hidden: torch.Tensor, anchor_valid: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """token_embeddings [N, S, K, H] (the target's rows of the candidates), log_probs [N, S, K] (their raw
        log-softmax, best first), pass_hidden [N, S, H] (the drafted slots' norm(x)), anchor_hidden [N, H] (ctx of
        the position before the anchor), anchor_valid [N] -> (start [N, K], pair [N, S - 1, K, K]) cosines."""
        n, s, k = log_probs.shape
        if not 1 <= s <= self.num_slots or k != self.top_k:
            raise ValueError(f"a LiLiCorr lattice of {s} slots x {k} candidates: this head has 1..{self.num_slots} "
                             f"slots x {self.top_k}")
        x = self.token_proj(token_embeddings) + self.pass_hidden_proj(pass_hidden)[:, :, None]
        x = x + self.feature_mlp(self.feature_norm(candidate_features(log_probs).to(x.dtype)))
        x = x + self.slot_embedding[:, 0, :s] + self.rank_embedding[:, 0]
        x = x.reshape(n, s * k, -1)
        bias = self.attention_bias(s)
        for layer in self.layers:
            x = layer(x, bias)
        x = self.output_norm(x).view(n, s, k, -1)
        anchor = self.context_proj(anchor_hidden) * anchor_valid[:, None].to(x.dtype)
        anchor = self.anchor_norm(anchor)
        a = anchor[:, None, None, :].expand_as(x)
        f = F.silu(self.factor_input_proj(torch.cat([x, a, x * a], dim=-1)))
        out_vec = F.normalize(self.out_head(f), dim=-1, eps=self.vector_eps)
        in_vec = F.normalize(self.in_head(f), dim=-1, eps=self.vector_eps)
        anchor_out = F.normalize(self.anchor_out_head(anchor), dim=-1, eps=self.vector_eps)
        start = torch.einsum("nd,nkd->nk", anchor_out, in_vec[:, 0])
        pair = torch.einsum("nsid,nsjd->nsij", out_vec[:, :-1], in_vec[:, 1:])
        return start, pair

    def log_factors(self, start: torch.Tensor, pair: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The cosines as the walk's logits, logit_scale x cos, fp32 (ModelOpt's compose_log_factors)."""
        return self.logit_scale * start.float(), self.logit_scale * pair.float()

    def walk_scores(self, *inputs) -> torch.Tensor:
        """`scores`' inputs -> vLLM's walk table [N, S, K, K] fp32: row [n, 0, i] = the start logits for every i
        (the walk enters at predecessor 0), row [n, s, i] = the pair logits out of candidate i of slot s - 1."""
        start, pair = self.log_factors(*self.scores(*inputs))
        return torch.cat([start[:, None, None, :].expand(-1, 1, self.top_k, -1), pair], dim=1)


def walk(table: torch.Tensor, draw=None) -> torch.Tensor:
    """The lattice walk of one block: table [S, K, K] (`walk_scores` of one row) -> candidate indices [S].
    Slot s reads row table[s, previous] (previous = 0 at slot 0): greedy takes its first argmax; `draw` (slot,
    scores [K] -> index) picks instead (sampling: a draw from softmax(score / T), vLLM's Gumbel-max)."""
    previous, picks = 0, []
    for s in range(table.shape[0]):
        row = table[s, previous]
        previous = int(row.argmax()) if draw is None else int(draw(s, row))
        picks.append(previous)
    return torch.tensor(picks, dtype=torch.long, device=table.device)


def candidates(logits: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] -> each row's top-K (ids [..., K], best first) and their raw log-softmax [..., K] fp32 (vLLM's
    `compute_candidates`: get_top_k_tokens(..., return_log_probs=True), no temperature)."""
    top = F.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return top.indices, top.values


def anchor_rows(ctx: torch.Tensor, batch: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The anchor input of every block of a batch: ctx [R, T, H] read at anchor - 1 (vLLM's prepare_context_anchor:
    the position before the block's given token) -> (anchor_hidden [R*A, H], valid [R*A]); invalid (zeroed by the
    head) at a row start, for an invalid anchor, and across a document start of a packed row."""
    anchors = batch["anchors"]
    before = (anchors - 1).clamp(min=0)
    docs = batch["document_ids"]
    valid = (anchors >= 1) & batch["anchor_valid"] & (docs.gather(1, before) == docs.gather(1, anchors))
    anchor_hidden = ctx.gather(1, before[..., None].expand(-1, -1, ctx.shape[-1])).reshape(-1, ctx.shape[-1])
    return anchor_hidden, valid.reshape(-1)


def lilicorr_walk(head: LiLiCorrHead, anchor_ctx: torch.Tensor, hidden: torch.Tensor, logits: torch.Tensor,
                  embed_tokens: torch.Tensor, draw=None) -> torch.Tensor:
    """Inference of one block as vLLM 0.32 drafts it (spec_decode/lilicorr, dflash2's CandidateSampler):
    anchor_ctx [H] (ctx of the position before the anchor), hidden [S, H] (the drafted slots' norm(x)), logits
    [S, V] (their unary logits) -> the drafted tokens [S]. Candidates: each slot's top-K with their raw log-softmax;
    greedy walks the table's first argmaxes; `draw` (logits [1, V] -> token [1]) is handed each slot's walk row at
    the K candidates' ids and -inf elsewhere (vLLM's cached draft logits, the q its rejection sampler reads as
    softmax(row / T)), and the walk goes on from the candidate drawn."""
    ids, log_probs = candidates(logits, head.top_k)
    emb = F.embedding(ids, embed_tokens).to(hidden.dtype)
    valid = torch.ones(1, dtype=torch.bool, device=hidden.device)
    table = head.walk_scores(emb[None], log_probs[None], hidden[None], anchor_ctx[None], valid)[0]
    pick = None
    if draw is not None:
        def pick(s, row):
            token = draw(row.new_full((1, logits.shape[-1]), float("-inf")).scatter(1, ids[s][None], row[None]))[0]
            return (ids[s] == token).nonzero()[0, 0]
    return ids.gather(1, walk(table, pick)[:, None])[:, 0]


class LatticeWeights(NamedTuple):
    """The lattice terms' absolute weights (ModelOpt's dflash_lilicorr_w_ce, _w_margin, _margin, _w_pen); the
    default is its `base` variant (w_ce 0.25, no hinge, w_pen 0.25), `margin` is (0.125, 0.125, 2.0, 0.25)."""

    w_ce: float = 0.25
    w_margin: float = 0.0
    margin: float = 2.0
    w_pen: float = 0.25

    @classmethod
    def named(cls, weights: Dict[str, float]) -> "LatticeWeights":
        """From the forward's family weights (loss.lilicorr_w_ce, _w_margin, _margin, _w_pen; the defaults for those
        not given)."""
        return cls(*(weights.get(f"lilicorr_{field}", default) for field, default in cls._field_defaults.items()))


class LatticeTerms(NamedTuple):
    """loss: w_ce CE + w_margin hinge + w_pen penalty (ModelOpt's absolute weights); ce, margin, penalty: the three
    terms before their weights; supervised [N, S] fp32: the slots they average over (the ground truth in the lattice
    at the slot and every slot before, every slot of the block trained); walk [N, S]: the greedy walk's indices."""

    loss: torch.Tensor
    ce: torch.Tensor
    margin: torch.Tensor
    penalty: torch.Tensor
    supervised: torch.Tensor
    walk: torch.Tensor


def lattice_loss(start: torch.Tensor, pair: torch.Tensor, candidate_ids: torch.Tensor, label: torch.Tensor,
                 block_trained: torch.Tensor, teacher_logits: Optional[torch.Tensor],
                 weights: LatticeWeights = LatticeWeights()) -> LatticeTerms:
    """ModelOpt's three lattice terms (hf_lilicorr.py `_compute_lilicorr_loss`, `_distractor_penalty`).

    start [N, K], pair [N, S - 1, K, K]: the walk's logits (`log_factors`); candidate_ids [N, S, K]; label [N, S]
    (the ground truth of each slot); block_trained [N] bool (every slot of the block trained); teacher_logits
    [N, S, K] (the teacher's logits at the candidates, no gradient; None when w_pen = 0).
    Slot s's node z_s = start (s = 0), else pair[s - 1] out of the ground truth's candidate at s - 1; over the
    supervised slots: CE = -log softmax(z_s)[g_s], hinge = relu(margin - (z_s[g_s] - max_{k != g_s} z_s[k])),
    penalty = sum_k softmax(z_s)_k relu(t_{g_s} - t_k); each averaged over the supervised slots."""
    w_ce, w_margin, margin, w_pen = weights
    n, s, k = candidate_ids.shape
    hits = candidate_ids == label[..., None]
    gt = hits.long().argmax(-1)  # [N, S]
    supervised = (hits.any(-1).long().cumprod(-1).bool() & block_trained[:, None]).float()
    previous = gt[:, :-1, None, None].expand(-1, -1, 1, k)
    node = torch.cat([start[:, None], pair.gather(2, previous)[:, :, 0]], dim=1)  # [N, S, K]
    log_q = F.log_softmax(node, dim=-1)
    ce_slot = -log_q.gather(-1, gt[..., None])[..., 0]
    denom = supervised.sum().clamp(min=1)
    ce = (ce_slot * supervised).sum() / denom
    loss = w_ce * ce
    margin_term = penalty = ce.new_zeros(())
    if w_margin > 0 and k > 1:
        z_gt = node.gather(-1, gt[..., None])[..., 0]
        runner_up = node.scatter(-1, gt[..., None], float("-inf")).max(-1).values
        margin_term = (torch.relu(margin - (z_gt - runner_up)) * supervised).sum() / denom
        loss = loss + w_margin * margin_term
    if w_pen > 0:
        t = teacher_logits.detach().float()
        rejection = (t.gather(-1, gt[..., None]) - t).clamp(min=0)
        penalty = ((log_q.exp() * rejection).sum(-1) * supervised).sum() / denom
        loss = loss + w_pen * penalty
    with torch.no_grad():
        table = torch.cat([start[:, None, None, :].expand(-1, 1, k, -1), pair], dim=1)
        picks = [table[:, 0, 0].argmax(-1)]
        for slot in range(1, s):
            picks.append(table[torch.arange(n, device=table.device), slot, picks[-1]].argmax(-1))
        walked = torch.stack(picks, dim=-1)
    return LatticeTerms(loss, ce, margin_term, penalty, supervised, walked)


def teacher_candidate_logits(last_rows: torch.Tensor, final_norm_weight: torch.Tensor, eps: float,
                             lm_head: torch.Tensor, candidate_ids: torch.Tensor) -> torch.Tensor:
    """The teacher's logits at the candidates, no gradient: last_rows [M, H] (the target's last hidden state at each
    slot's teacher position), candidate_ids [M, K] -> [M, K] fp32, from the K lm_head rows (never [M, V])."""
    with torch.no_grad():
        xt = rms_norm(last_rows, final_norm_weight.to(last_rows.dtype), eps)
        return torch.einsum("mh,mkh->mk", xt.to(lm_head.dtype), lm_head[candidate_ids]).float()


def lattice_terms(head: LiLiCorrHead, ctx: torch.Tensor, batch: Dict[str, torch.Tensor], hidden: torch.Tensor,
                  out, teacher, label: torch.Tensor, slot_mask: torch.Tensor, embed_tokens: torch.Tensor,
                  lm_head: torch.Tensor, weights: LatticeWeights) -> Tuple[LatticeTerms, torch.Tensor]:
    """The lattice terms of a training batch (slot 0 of each block given, slots 1..B-1 the lattice): ctx [R, T, H]
    (the context, the anchors read it at anchor - 1: invalid at a row or document start), hidden [R*A*B, H] (the
    slots' norm(x)), out: the lm_head loss's `LossOutput` with topk = K (candidates, logits, lse), teacher: its
    `Teacher` (the penalty reads `last`), label [R*A*B] (the loss kind's label), slot_mask [R, A, B]
    -> (`lattice_loss`'s terms, the greedy walk's tokens [R*A, B - 1])."""
    r, a, b = slot_mask.shape
    k = head.top_k
    ids = out.topk_ids.view(r * a, b, k)[:, 1:]
    log_probs = (out.topk_logits - out.lse[:, None]).view(r * a, b, k)[:, 1:]
    pass_hidden = hidden.view(r * a, b, -1)[:, 1:]
    anchor_hidden, valid = anchor_rows(ctx, batch)
    emb = F.embedding(ids, embed_tokens).to(hidden.dtype)
    start, pair = head.log_factors(*head.scores(emb, log_probs, pass_hidden, anchor_hidden, valid))
    teacher_logits = None
    if weights.w_pen > 0:
        if teacher.last is None:
            raise ValueError("LiLiCorr's distractor penalty (lilicorr w_pen > 0) weighs each candidate by the "
                             "teacher's logits, which this loss kind does not read: use a store with `last` and a "
                             "dense kind (kl, tv, ...), or set w_pen 0")
        rows = teacher.last[teacher.index].view(r * a, b, -1)[:, 1:].reshape(r * a * (b - 1), -1)
        teacher_logits = teacher_candidate_logits(rows, teacher.final_norm_weight, head.eps, lm_head,
                                                  ids.reshape(-1, k)).view(r * a, b - 1, k)
    block_trained = slot_mask.view(r * a, b)[:, 1:].all(-1)
    terms = lattice_loss(start, pair, ids, label.view(r * a, b)[:, 1:], block_trained, teacher_logits, weights)
    return terms, ids.gather(-1, terms.walk[..., None])[..., 0]


def head_shapes(cfg) -> Dict[str, Tuple[int, ...]]:
    """name -> shape of every parameter a LiLiCorr DrafterConfig adds to the backbone, from the sizes alone: DFlash2's
    convolutions when asked (conv_kernel_size), then the lattice head's (built on the meta device: no memory)."""
    with torch.device("meta"):
        head = LiLiCorrHead(cfg)
    return {**dflash2.head_shapes(cfg), **{f"lilicorr.{name}": tuple(p.shape) for name, p in head.named_parameters()}}


class LiLiCorrDrafter(DFlash2Drafter):
    """LiLiCorr: the backbone (DFlash2's convolutions in the layers when conv_kernel_size > 0; no selector, which
    `value_problems` refuses beside it) plus the lattice head `lilicorr`. The fused lm_head pass gives each slot's
    top-K candidates, their logits and lse; the lattice terms are added to the main loss, and the draft the metrics
    score and `propose` returns is the lattice walk's. The export gate compares the logits and `gate_outputs`: the
    lattice's scores, walk table and greedy walk."""

    family = "lilicorr"

    def add_heads(self) -> None:
        super().add_heads()
        self.lilicorr = LiLiCorrHead(self.config)

    def reset_parameters(self, std: float = 0.02):
        super().reset_parameters(std)  # the backbone's, and DFlash2's convolutions to identity
        self.lilicorr.reset_parameters(std)

    def loss_head(self, step: Step) -> Tuple[Dict[str, Any], Any]:  # noqa: ARG002 (the step is family_terms')
        """The fused lm_head pass also returns each slot's top-K candidates, their logits and each row's lse."""
        return {"topk": self.lilicorr.top_k}, None

    def family_terms(self, step: Step, out: LossOutput, teacher_argmax: torch.Tensor, state: Any,  # noqa: ARG002
                     weights: Dict[str, float]) -> FamilyTerms:
        """loss += ModelOpt's lattice terms with the weights loss.lilicorr_w_ce, _w_margin, _margin, _w_pen
        (`lattice_terms`); the draft is slot 0's argmax and the greedy lattice walk's tokens after it: acc_j and
        tau_offline are LiLiCorr's."""
        r, a, b = step.targets.slot_mask.shape
        n = step.weights.shape[0]
        hidden = ops.rms_norm(step.x.reshape(n, -1), self.norm.weight, self.norm.eps)
        lattice, walked = lattice_terms(self.lilicorr, step.ctx, step.batch, hidden, out, step.teacher,
                                        teacher_argmax, step.targets.slot_mask, self.embed_tokens, self.lm_head,
                                        LatticeWeights.named(weights))
        draft = torch.cat([out.draft_argmax.view(r * a, b)[:, :1], walked], dim=1).reshape(-1)
        return FamilyTerms(lattice.loss, draft, {"lattice_loss": lattice.loss})

    def gate_outputs(self, batch: Dict[str, torch.Tensor], logits: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The lattice of every block of the one-row gate batch as vLLM's LiLiCorr scores it: the candidates of each
        drafted slot are the top-K of `logits` [1, A*B, V] (the trained drafter's) with their log-softmax, the slots'
        norm(x) this drafter's, the anchor its ctx at anchor - 1 -> start [A, K] and pair [A, B - 2, K, K] cosines,
        the walk table [A, B - 1, K, K] and the greedy walk's candidate indices [A, B - 1] (as fp32)."""
        b, k = self.config.block_size, self.lilicorr.top_k
        ctx = self.context(batch["hidden"])
        x = self.batch_states(batch, ctx=ctx)
        a = x.shape[1] // b
        ids, log_probs = candidates(logits[0, :, : self.config.vocab_size].view(a, b, -1)[:, 1:], k)
        hidden = self.norm(x).view(a, b, -1)[:, 1:]
        inputs = (F.embedding(ids, self.embed_tokens).to(hidden.dtype), log_probs, hidden, *anchor_rows(ctx, batch))
        start, pair = self.lilicorr.scores(*inputs)
        table = self.lilicorr.walk_scores(*inputs)
        return {"LiLiCorr start scores": start.float(), "LiLiCorr pair scores": pair.float(),
                "LiLiCorr walk table": table, "LiLiCorr greedy walk": torch.stack([walk(t) for t in table]).float()}

    def walk(self, x: torch.Tensor, hidden: torch.Tensor, logits: torch.Tensor,  # noqa: ARG002 (x: unread)
             anchor_token: int, draw=None, with_confidence: bool = False,  # noqa: ARG002 (the lattice's own start)
             context: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The lattice walk (`lilicorr_walk`) from the context row before the anchor (context[-1])."""
        first = self.config.first_slot
        return lilicorr_walk(self.lilicorr, context[-1], hidden[first:], logits[first:], self.embed_tokens,
                             draw), None
