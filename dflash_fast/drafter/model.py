"""The DFlash drafter (SPEC §3-5): fc over the K tapped layers, N Qwen3-style layers
attending to [ctx ; block], the target's frozen embedding, final norm and lm_head.

    hidden [R, T, K, H_t] --fc_concat--> ctx [R, T, H]
    block ids [R, A*B] --embed--> x --N layers (q from x; k/v from [ctx ; x])--> x
    x --norm, lm_head, loss vs teacher at p-1--> loss, argmaxes

DSpark (SPEC §8, `markov_rank > 0` or `confidence_head`): the same backbone plus the heads of
`dflash_fast.drafter.dspark`; the Markov bias rides in the lm_head loss (eager.Markov), the confidence head is
trained against the acceptance rate the loss returns.

DFlash2 (SPEC §9, `conv_kernel_size > 0` or `selector_rank > 0`): the convolutions live in each
`layers.DecoderLayer`; the candidate selector (`dflash_fast.drafter.dflash2`) re-ranks the unary top-K the lm_head loss
returns, and its K-way cross-entropy joins the loss.

The three hot ops go through `dflash_fast.drafter.ops`; everything else is plain torch. Here: where every slot's teacher
lives (`slot_targets`, `slot_teacher`), `DFlashDrafter`, the metrics' sums and `build_drafter`; the architecture is
`drafter_config.DrafterConfig`, the decoder layer `layers.DecoderLayer`, the weights read from files `weights`.
"""
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash_fast.drafter import ops
from dflash_fast.drafter.config import DrafterConfig
from dflash_fast.drafter.dflash2 import CandidateSelector, DynamicConv, selector_loss
from dflash_fast.drafter.dspark import ConfidenceHead, MarkovHead
from dflash_fast.drafter.eager import DENSE_KINDS, DPace, Markov, Teacher, needs_last
from dflash_fast.drafter.layers import DecoderLayer, RMSNorm, Rope
from dflash_fast.drafter.weights import check_drafter_fits_target, load_frozen_tensors

# A target whose tokenizer has no mask token and no spare embedding row (SmolLM2, Llama-2, ...) embeds the mask
# slots with the first of these special tokens it has: speculators' order (speculators/train/utils.py
# resolve_mask_token_id). The row is frozen and only ever embedded at draft slots, so any row works that the drafter
# sees nowhere else as a draft slot's input; the export writes the id, so every engine embeds the same row.
MASK_FALLBACKS = ("pad_token_id", "eos_token_id", "unk_token_id")


def resolve_mask_token_id(vocab_size: int, mask_token_id: Optional[int] = None, tokenizer=None) -> int:
    """`model.mask_token_id`, else the tokenizer's mask token, else the last embedding row the
    tokenizer does not use (targets such as Qwen3 pad their embedding beyond the tokenizer), else the tokenizer's
    pad, eos or unk token (MASK_FALLBACKS)."""
    if mask_token_id is None and tokenizer is not None and tokenizer.mask_token_id is not None:
        mask_token_id = tokenizer.mask_token_id
    if mask_token_id is None and tokenizer is not None and len(tokenizer) < vocab_size:
        mask_token_id = vocab_size - 1
    if mask_token_id is None and tokenizer is not None:
        mask_token_id = next((getattr(tokenizer, name, None) for name in MASK_FALLBACKS
                              if getattr(tokenizer, name, None) is not None), None)
    if mask_token_id is None:
        raise ValueError(
            f"no mask token: the tokenizer has no mask, pad, eos or unk token and uses all {vocab_size} embedding "
            f"rows; set model.mask_token_id"
        )
    if not 0 <= mask_token_id < vocab_size:
        raise ValueError(f"mask token id {mask_token_id} is outside the target embedding (0..{vocab_size - 1})")
    return mask_token_id


def position_weights(block_size: int, gamma: float, sample_from_anchor: bool = False) -> torch.Tensor:
    """SPEC §5: w_0 = 0, w_j = exp(-(j - 1) / gamma) -> [B]; with sample_from_anchor (SPEC §8) every slot
    predicts and the decay starts at slot 0: w_j = exp(-j / gamma)."""
    j = torch.arange(block_size, dtype=torch.float32)
    if sample_from_anchor:
        return torch.exp(-j / gamma)
    return torch.where(j >= 1, torch.exp(-(j - 1) / gamma), torch.zeros(()))


class Targets(NamedTuple):
    """Where every slot's teacher lives. All [R, A, B]."""

    slot_mask: torch.Tensor  # bool: trained and scored (slot predicts, valid anchor, in row, same document, loss_mask)
    position: torch.Tensor  # the predicted position (p = a + j, or p + 1 with sample_from_anchor), clamped into the row
    teacher_row: torch.Tensor  # the predicted position - 1, clamped into the row
    prev_position: torch.Tensor  # DSpark's previous token: predicted position - 1, slot 0 its own (>= a), in the row


def slot_targets(batch: Dict[str, torch.Tensor], block_size: int, sample_from_anchor: bool = False) -> Targets:
    """SPEC §5: slot j of the block at anchor a sits at p = a + j, predicts the token at p and is scored against
    the teacher at p - 1; slot 0 (the given token) never trains. With sample_from_anchor (SPEC §8) slot j
    predicts the token at p + 1, slot 0 included, against the teacher at p. The masks apply to the predicted
    position."""
    anchors, valid = batch["anchors"], batch["anchor_valid"]
    t = batch["input_ids"].shape[1]
    j = torch.arange(block_size, device=anchors.device)
    p = anchors[:, :, None] + j + int(sample_from_anchor)
    in_row = p.clamp(max=t - 1)
    gather = lambda src: src.gather(1, in_row.flatten(1)).view(in_row.shape)
    anchor_doc = batch["document_ids"].gather(1, anchors)[:, :, None]
    mask = (
        (j >= (0 if sample_from_anchor else 1))
        & valid[:, :, None]
        & (p < t)
        & (gather(batch["document_ids"]) == anchor_doc)
        & gather(batch["loss_mask"].bool())
    )
    prev = torch.maximum(p - 1, anchors[:, :, None]).clamp(max=t - 1)
    return Targets(mask, in_row, (p - 1).clamp(0, t - 1), prev)


def teacher_index(targets: Targets, seq_len: int) -> torch.Tensor:
    """[R*A*B] row of last.flatten(0, 1) ([R*T, H]) each slot is scored against: its position p - 1 in its row.
    Overlapping blocks share these rows, so the loss computes each teacher row's logits once."""
    r = targets.teacher_row.shape[0]
    offsets = torch.arange(r, device=targets.teacher_row.device)[:, None, None] * seq_len
    return (targets.teacher_row + offsets).flatten()


def gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [R, T, ...] at row positions rows [R, A, B] -> [R*A*B, ...]."""
    r, t = x.shape[:2]
    idx = rows.reshape(r, -1)
    return x.gather(1, idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])).flatten(0, 1)


def slot_teacher(
    batch: Dict[str, torch.Tensor], targets: Targets, loss_kind: str, target_norm: torch.Tensor, dtype: torch.dtype
) -> Tuple[Teacher, Optional[torch.Tensor]]:
    """What every slot is scored against for `loss_kind` (SPEC §5: the teacher at the predicted position - 1;
    ce_data's label at the predicted position), and the stored teacher argmax [R*A*B] (None without topk ids).
    `target_norm`: the target's effective final-norm weight [H]; `dtype`: the compute dtype of `last`."""
    stored_argmax = (
        gather_rows(batch["teacher_topk_ids"], targets.teacher_row)[:, 0] if "teacher_topk_ids" in batch else None
    )
    if needs_last(loss_kind, stored_argmax is not None):
        if "last" not in batch:
            raise ValueError(
                f"loss kind {loss_kind!r} needs `last` in the store; use ce or kl_topk with a --no-last store"
            )
        teacher = Teacher(
            last=batch["last"].flatten(0, 1).to(dtype),
            final_norm_weight=target_norm.to(dtype),
            index=teacher_index(targets, batch["last"].shape[1]),
        )
    elif loss_kind == "ce":
        teacher = Teacher(labels=stored_argmax)
    elif loss_kind == "ce_data":
        teacher = Teacher(labels=gather_rows(batch["input_ids"], targets.position))
    elif loss_kind == "kl_topk":
        teacher = Teacher(
            topk_ids=gather_rows(batch["teacher_topk_ids"], targets.teacher_row),
            topk_logits=gather_rows(batch["teacher_topk_logits"], targets.teacher_row),
            topk_lse=gather_rows(batch["teacher_lse"], targets.teacher_row),
        )
    else:
        raise ValueError(f"unknown loss kind {loss_kind!r}")
    return teacher, stored_argmax


def confidence_terms(
    confidence_logit: torch.Tensor, alpha: torch.Tensor, decay: torch.Tensor, slot_mask: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """DSpark's confidence head (SPEC §8) on confidence logits [R*A*B]: its BCE against the acceptance rate alpha
    [R*A*B], weighted with the decay [R, A, B] over the trained slots (slot_mask [R, A, B]), and its probability
    [R, A, B] (no gradient)."""
    logit = confidence_logit.float()
    bce = F.binary_cross_entropy_with_logits(logit, alpha, reduction="none")
    confidence_loss = (bce * decay.reshape(-1)).sum() / slot_mask.sum().clamp(min=1)
    return confidence_loss, torch.sigmoid(logit.detach()).view(slot_mask.shape)


class DrafterOutput(NamedTuple):
    loss: torch.Tensor
    kl: Optional[torch.Tensor]
    draft_argmax: torch.Tensor  # [R, A, B]
    teacher_argmax: torch.Tensor  # [R, A, B] (the teacher's argmax at the predicted position - 1)
    slot_mask: torch.Tensor  # [R, A, B] bool
    alpha: torch.Tensor  # [R, A, B] fp32: each slot's acceptance estimate sum_v min(p_v, q_v) (eager.LossOutput)
    first_slot: int = 1  # the first slot that predicts (DrafterConfig.first_slot)
    confidence_loss: Optional[torch.Tensor] = None  # DSpark: the confidence BCE (before confidence_alpha)
    confidence: Optional[torch.Tensor] = None  # DSpark: [R, A, B] the confidence head's probability (no gradient)
    selector_loss: Optional[torch.Tensor] = None  # DFlash2: the selector's CE (before selector_alpha)
    recall: Optional[torch.Tensor] = None  # DFlash2: [R, A, B] bool, the teacher argmax is in the unary top-K
    selector_hit: Optional[torch.Tensor] = None  # DFlash2: [R, A, B] bool, recall and the selector picks it


class DFlashDrafter(nn.Module):
    """Trainable: fc, hidden_norm, layers, norm (and DSpark's markov_head, confidence_head; DFlash2's convolutions
    in the layers and candidate_selector). Frozen buffers: embed_tokens, lm_head, target_norm."""

    def __init__(self, cfg: DrafterConfig, frozen_dtype: torch.dtype = torch.float32):
        """`frozen_dtype`: the dtype of embed_tokens and lm_head ([V, H] each); target_norm stays fp32."""
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_tapped * cfg.target_hidden_size, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.rope = Rope(cfg)
        # Zeros of the right shape and dtype that take no memory (one element, expanded) until set_frozen gives the
        # target's: a config read from a file builds nothing its weights do not back.
        placeholder = torch.zeros((), dtype=frozen_dtype).expand(cfg.vocab_size, h)
        self.register_buffer("embed_tokens", placeholder, persistent=False)
        self.register_buffer("lm_head", placeholder, persistent=False)
        self.register_buffer(
            "target_norm", torch.ones(h), persistent=False
        )  # effective weight (1 + w for zero-centred norms)
        self.markov_head = (
            MarkovHead(cfg.vocab_size, cfg.markov_rank, h, cfg.markov_head_type) if cfg.markov_rank else None
        )
        self.confidence_head = (
            ConfidenceHead(h + (cfg.markov_rank if cfg.confidence_head_with_markov else 0))
            if cfg.confidence_head
            else None
        )
        self.candidate_selector = (
            CandidateSelector(cfg.vocab_size, h, cfg.selector_rank, cfg.selector_top_k) if cfg.selector_rank else None
        )
        # Activation checkpointing of the layers (model.activation_checkpointing): a training choice, not architecture.
        self.checkpoint_layers = False
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
        if self.markov_head is not None:
            self.markov_head.reset_parameters(std)
        for m in self.modules():
            if isinstance(m, DynamicConv):
                m.reset_parameters()  # identity: a fresh DFlash2 is DFlash
        if self.candidate_selector is not None:
            self.candidate_selector.reset_parameters(std)

    def load_trainable(self, weights: Dict[str, torch.Tensor]) -> None:
        """Copy `weights` (name -> tensor, passed by check_tensors) into the trainable parameters."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(weights[name].to(p.dtype))

    def set_frozen(self, embed_tokens: torch.Tensor, lm_head: torch.Tensor, target_norm: torch.Tensor):
        """Copy the target's frozen tensors in (shapes [V, H], [V, H], [H])."""
        for name, value in (("embed_tokens", embed_tokens), ("lm_head", lm_head), ("target_norm", target_norm)):
            buf = getattr(self, name)
            if tuple(value.shape) != tuple(buf.shape):
                raise ValueError(
                    f"target {name} has shape {tuple(value.shape)}, the drafter expects {tuple(buf.shape)}"
                )
            setattr(self, name, value.detach().to(device=buf.device, dtype=buf.dtype))

    def context(self, hidden: torch.Tensor, noise_std: float = 0.0, seed: int = 0) -> torch.Tensor:
        """hidden [R, T, K, H_t] -> ctx [R, T, H] = hidden_norm(fc(concat_k hidden)) (SPEC §3)."""
        r, t, k, h_t = hidden.shape
        ctx = ops.fc_concat(
            hidden.reshape(r * t, k, h_t),
            self.fc.weight,
            self.hidden_norm.weight,
            self.config.rms_norm_eps,
            noise_std,
            seed,
        )
        return ctx.view(r, t, -1)

    def block_states(
        self, ctx, ctx_positions, input_ids_at_anchor, anchor_positions, anchors, anchor_valid, document_ids
    ):
        """The N layers over every block. ctx [R, T, H]; ctx_positions [R, T] (RoPE positions);
        input_ids_at_anchor, anchor_positions, anchors, anchor_valid [R, A]; document_ids [R, T]
        -> pre-norm states [R, A*B, H]."""
        cfg = self.config
        r, a = anchors.shape
        b = cfg.block_size
        ids = torch.full((r, a, b), cfg.mask_token_id, dtype=torch.long, device=anchors.device)
        ids[:, :, 0] = input_ids_at_anchor
        x = F.embedding(ids.view(r, a * b), self.embed_tokens).to(ctx.dtype)
        blk_pos = (anchor_positions[:, :, None] + torch.arange(b, device=anchors.device)).view(r, a * b)
        blk_cs, ctx_cs = self.rope.cos_sin(blk_pos, x.dtype), self.rope.cos_sin(ctx_positions, x.dtype)
        attn = dict(anchors=anchors, anchor_valid=anchor_valid, document_ids=document_ids, block_size=b)
        for layer in self.layers:
            if self.checkpoint_layers and torch.is_grad_enabled():  # keep x only; recompute the layer in backward
                x = checkpoint(layer, x, ctx, self.rope, blk_cs, ctx_cs, attn, use_reentrant=False)
            else:
                x = layer(x, ctx, self.rope, blk_cs, ctx_cs, attn)
        return x

    def batch_states(self, batch: Dict[str, torch.Tensor], noise_std: float = 0.0, seed: int = 0) -> torch.Tensor:
        """Pre-norm block states [R, A*B, H] of a collated batch (keys as in dflash_fast.data.batches): the context
        from the tapped hidden states, then the N layers over every anchor's block."""
        anchors = batch["anchors"]
        return self.block_states(
            self.context(batch["hidden"], noise_std, seed),
            batch["position_ids"],
            batch["input_ids"].gather(1, anchors),
            batch["position_ids"].gather(1, anchors),
            anchors,
            batch["anchor_valid"],
            batch["document_ids"],
        )

    def forward(
        self,
        batch: Dict[str, torch.Tensor],
        loss_kind: str = "kl",
        gamma: float = 7.0,
        noise_std: float = 0.0,
        seed: int = 0,
        weighting: str = "decay",
        dpace_alpha: float = 0.5,
        confidence_alpha: float = 1.0,
        selector_alpha: float = 1.0,
    ) -> DrafterOutput:
        """Training forward on a collated batch (keys as in dflash_fast.data.batches).

        weighting: "decay" (SPEC §5 position weights with `gamma`) or "dpace" (D-PACE with `dpace_alpha`,
        computed inside the loss from the drafter's confidence). DSpark (SPEC §8): loss = the main loss on the
        Markov-biased logits + confidence_alpha x the confidence head's BCE against the acceptance rate,
        weighted with the decay whatever `weighting` is. DFlash2 (SPEC §9): loss = the main loss + selector_alpha x
        the selector's K-way CE against the teacher argmax (`dflash2.selector_loss`), weighted like the main loss.
        """
        cfg = self.config
        anchors = batch["anchors"]
        r, a = anchors.shape
        b = cfg.block_size
        x = self.batch_states(batch, noise_std, seed)
        targets = slot_targets(batch, b, cfg.sample_from_anchor)
        dpace = DPace(dpace_alpha, b) if weighting == "dpace" else None
        decay = position_weights(b, gamma, cfg.sample_from_anchor).to(x.device) * targets.slot_mask
        weights = targets.slot_mask.float() if dpace else decay
        n = r * a * b
        if self.confidence_head is not None and loss_kind not in DENSE_KINDS:
            raise ValueError(
                f"the confidence head learns the acceptance rate sum_v min(q_v, p_v) against the full teacher: loss "
                f"kind {loss_kind!r} has none; use one of {DENSE_KINDS} (a store with `last`)"
            )
        prev_ids = gather_rows(batch["input_ids"], targets.prev_position)
        markov, confidence_logit = self.dspark_heads(x, prev_ids)
        teacher, stored_argmax = slot_teacher(batch, targets, loss_kind, self.target_norm, x.dtype)
        selector = self.candidate_selector
        out = ops.lm_head_loss(
            x.reshape(n, -1),
            self.norm.weight,
            self.lm_head.to(x.dtype),
            weights.reshape(n),
            loss_kind,
            targets.slot_mask.sum(),
            cfg.rms_norm_eps,
            teacher,
            dpace,
            markov=markov,
            **({"topk": selector.top_k} if selector is not None else {}),
        )
        teacher_argmax = stored_argmax if stored_argmax is not None and loss_kind == "ce_data" else out.teacher_argmax
        loss, confidence_loss, confidence = out.loss, None, None
        if confidence_logit is not None:
            confidence_loss, confidence = confidence_terms(confidence_logit, out.alpha, decay, targets.slot_mask)
            loss = loss + confidence_alpha * confidence_loss
        sel, draft = None, out.draft_argmax
        if selector is not None:  # the draft is the selector's pick (SPEC §9): acc_j and tau_offline are the selector's
            hidden = ops.rms_norm(x.reshape(n, -1), self.norm.weight, self.norm.eps)
            sel = selector_loss(selector, hidden, self.lm_head, prev_ids, out.topk_ids,
                                teacher_argmax, weights.reshape(n), targets.slot_mask.sum(), dpace, out.topk_logits)
            loss, draft = loss + selector_alpha * sel.loss, sel.draft
        return DrafterOutput(loss, out.kl, draft.view(r, a, b), teacher_argmax.view(r, a, b),
                             targets.slot_mask, out.alpha.view(r, a, b), cfg.first_slot, confidence_loss, confidence,
                             *((sel.loss, sel.recall.view(r, a, b), sel.hit.view(r, a, b)) if sel else ()))

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

    def block_logits(self, batch: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Materialised fp32 logits of every slot [R, A*B, V], Markov bias (from the ground-truth previous tokens)
        included, and the confidence logits [R, A*B] or None: for the export gate, not for training."""
        x = self.batch_states(batch)
        targets = slot_targets(batch, self.config.block_size, self.config.sample_from_anchor)
        markov, confidence = self.dspark_heads(x, gather_rows(batch["input_ids"], targets.prev_position))
        logits = F.linear(self.norm(x), self.lm_head.to(x.dtype))
        if markov is not None:
            logits = logits + F.linear(markov.e, markov.w2).view(logits.shape)
        return logits.float(), None if confidence is None else confidence.float().view(x.shape[:2])

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, anchor_token: int, with_confidence: bool = False, draw=None):
        """Inference for one sequence: hidden [T, K, H_t] of positions 0..T-1 (all the target has
        processed), anchor token at position T -> greedy guesses for positions T+1..T+B-1 [B-1]
        (T+1..T+B [B] with sample_from_anchor). With a Markov head the block is drafted slot by slot,
        each slot's bias from the token drafted for the position before its own (the anchor's token first); with
        DFlash2's selector likewise, each slot's pick among its unary top-K (`selector_walk`).
        with_confidence (a drafter with a confidence head): (guesses, the head's acceptance probability of
        each guess [same length]). draw: logits [n, V] -> tokens [n] (default argmax), every drafted slot's
        token picked through it, slot by slot with a Markov head (sampling.DraftSampler samples them)."""
        t = hidden.shape[0]
        dev = hidden.device
        ctx = self.context(hidden[None].to(self.fc.weight.dtype))
        anchors = torch.tensor([[t]], device=dev)
        one_document = torch.zeros(1, t, dtype=torch.long, device=dev)
        x = self.block_states(
            ctx,
            torch.arange(t, device=dev)[None],
            torch.tensor([[anchor_token]], device=dev),
            anchors,
            anchors,
            torch.ones(1, 1, dtype=torch.bool, device=dev),
            one_document,
        )
        hidden_normed = self.norm(x[0])  # [B, H]
        logits = F.linear(hidden_normed, self.lm_head.to(x.dtype))
        first = self.config.first_slot
        features = hidden_normed[first:]
        if self.candidate_selector is not None:  # greedy without a draw: the best score, not the argmax of a row
            guesses = self.selector_walk(hidden_normed, logits, anchor_token, draw)
        elif self.markov_head is None:
            guesses = (draw or _argmax)(logits[first:])
        else:
            draw = draw or _argmax
            head, shift = self.markov_head, int(self.config.sample_from_anchor)
            tokens = [torch.tensor(anchor_token, device=dev)]  # tokens[m]: the token at position T + m
            state, e_prevs = hidden_normed.new_zeros(head.rank), []
            for k in range(self.config.block_size):
                e_prev = head.markov_w1(tokens[max(k + shift - 1, 0)]).to(x.dtype)
                e, state = head.step(e_prev, hidden_normed[k], state)
                if k >= first:
                    tokens.append(draw((logits[k] + head.markov_w2(e))[None])[0])
                    e_prevs.append(e_prev)
            guesses = torch.stack(tokens[1:])
            if self.config.confidence_head_with_markov:
                features = torch.cat([features, torch.stack(e_prevs)], dim=-1)
        if not with_confidence:
            return guesses
        return guesses, torch.sigmoid(self.confidence_head(features).float())

    def selector_walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_token: int, draw=None) -> torch.Tensor:
        """SPEC §9 inference of one block: hidden [B, H] (norm(x)), unary logits [B, V] -> the drafted tokens
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


def _argmax(slot_logits: torch.Tensor) -> torch.Tensor:
    """The greedy draw of `propose`: logits [n, V] -> tokens [n]."""
    return slot_logits.argmax(-1)


def slot_metrics(out: DrafterOutput) -> Dict[str, torch.Tensor]:
    """Sums for SPEC §6 metrics (reduce across ranks, then divide): acc_hits/acc_count [B] per slot,
    alpha_sum [B] (acceptance estimates of the valid slots, over acc_count), tau_sum (sum over valid blocks
    of 1 + leading matches), blocks (valid block count)."""
    match = (out.draft_argmax == out.teacher_argmax) & out.slot_mask
    first = out.first_slot
    valid_block = out.slot_mask[..., first]  # an anchor is eligible only if its first predicting slot trains (SPEC §3)
    leading = match[..., first:].long().cumprod(-1).sum(-1)
    return {
        "acc_hits": match.flatten(0, 1).sum(0).float(),
        "acc_count": out.slot_mask.flatten(0, 1).sum(0).float(),
        "alpha_sum": (out.alpha * out.slot_mask).flatten(0, 1).sum(0).float(),
        "tau_sum": ((1 + leading) * valid_block).sum().float(),
        "blocks": valid_block.sum().float(),
    }


def build_drafter(
    target_path: str,
    layer_ids: List[int],
    mask_token_id: Optional[int] = None,
    norm_kind: Optional[str] = None,
    frozen_dtype: torch.dtype = torch.float32,
    **options,
) -> DFlashDrafter:
    """A fresh drafter for the target at `target_path` with its frozen tensors loaded in `frozen_dtype`
    (`norm_kind`: see load_frozen_tensors). Trainable weights are fp32 whatever `frozen_dtype` is;
    loading the [V, H] embedding and lm_head straight in the compute dtype spares every rank an fp32 copy."""
    from transformers import AutoConfig, AutoTokenizer

    target_config = AutoConfig.from_pretrained(target_path)
    vocab = (target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config).vocab_size
    tokenizer = None
    if mask_token_id is None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(target_path)
        except (OSError, ValueError):
            tokenizer = None
    cfg = DrafterConfig.from_target(
        target_config, layer_ids, resolve_mask_token_id(vocab, mask_token_id, tokenizer), **options
    )
    check_drafter_fits_target(cfg, target_path)
    drafter = DFlashDrafter(cfg, frozen_dtype)
    drafter.set_frozen(**load_frozen_tensors(target_path, frozen_dtype, norm_kind=norm_kind))
    return drafter
