"""The DFlash drafter (spec.md §3-5): the backbone every drafter family shares, and the interface a family implements.

    hidden [R, T, K, H_t] --fc_concat--> ctx [R, T, H]
    block ids [R, A*B] --embed--> x --N layers (q from x; k/v from [ctx ; x])--> x
    x --norm, lm_head, loss vs teacher at p-1--> loss, argmaxes

`DFlashDrafter` is the DFlash family itself. Every other family is a subclass in its own module (DSpark in
dspark.py, DFlash2 in dflash2.py, LiLiCorr in lilicorr.py) that names itself in `family` (the value
`DrafterConfig.family` gives its options) and overrides the hooks below; nothing outside its module branches on the
family:

    add_heads()                       build its own modules (registered on the drafter under their export names)
    reset_parameters(std)             super(), then its own initialisation
    loss_head(step)                   -> (extra keyword arguments of ops.lm_head_loss, state for family_terms)
    family_terms(step, out, label, state, weights)
                                      -> FamilyTerms: its loss term (already scaled by its weight, read from
                                         `weights`: the forward's keyword arguments such as selector_alpha), the
                                         draft the metrics score, its DrafterOutput fields
    logits_with_heads(batch, x, logits)
                                      -> the export gate's materialised logits and confidence
    walk(x, hidden, logits, anchor_token, draw, with_confidence, context)
                                      -> the proposal of one block (spec.md §6, §10) and its confidence or None
                                         (context: the sequence's ctx rows, LiLiCorr's anchor reads the last)
    gate_outputs(batch, logits)       -> what the export gate compares beside the logits (DFlash2: selector scores)

`DFlashDrafter(cfg)` builds the family `cfg.family` names: the subclass registers itself when its module is
imported, and families.py (imported by weights.py and model.py) imports every family (docs/contributing.md, "A drafter
family").
"""
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash_fast.drafter import ops
from dflash_fast.drafter.config import DrafterConfig
from dflash_fast.drafter.layers import DecoderLayer, RMSNorm, Rope
from dflash_fast.drafter.losses import DPace, LossOutput, Teacher
from dflash_fast.drafter.targets import Targets, gather_rows, position_weights, slot_targets, slot_teacher


class DrafterOutput(NamedTuple):
    loss: torch.Tensor
    kl: Optional[torch.Tensor]
    draft_argmax: torch.Tensor  # [R, A, B]
    teacher_argmax: torch.Tensor  # [R, A, B] (the teacher's argmax at the predicted position - 1)
    slot_mask: torch.Tensor  # [R, A, B] bool
    alpha: torch.Tensor  # [R, A, B] fp32: each slot's acceptance estimate sum_v min(p_v, q_v) (losses.LossOutput)
    first_slot: int = 1  # the first slot that predicts (DrafterConfig.first_slot)
    confidence_loss: Optional[torch.Tensor] = None  # DSpark: the confidence BCE (before confidence_alpha)
    confidence: Optional[torch.Tensor] = None  # DSpark: [R, A, B] the confidence head's probability (no gradient)
    selector_loss: Optional[torch.Tensor] = None  # DFlash2: the selector's CE (before selector_alpha)
    recall: Optional[torch.Tensor] = None  # DFlash2: [R, A, B] bool, the teacher argmax is in the unary top-K
    selector_hit: Optional[torch.Tensor] = None  # DFlash2: [R, A, B] bool, recall and the selector picks it
    lattice_loss: Optional[torch.Tensor] = None  # LiLiCorr: the lattice terms, weighted (lilicorr.lattice_loss)


class Step(NamedTuple):
    """What the training forward hands a family's loss hooks."""

    x: torch.Tensor  # [R, A*B, H] pre-norm block states
    targets: Targets
    prev_ids: torch.Tensor  # [R*A*B] each slot's previous token (Targets.prev_position), what family heads read
    weights: torch.Tensor  # [R*A*B] the main loss's row weights (the decay, or the slot mask under D-PACE)
    decay: torch.Tensor  # [R, A, B] the decay over the trained slots (spec.md §5)
    dpace: Optional[DPace]
    loss_kind: str
    ctx: torch.Tensor  # [R, T, H] the context the layers read (LiLiCorr's anchor reads it at anchor - 1)
    batch: Dict[str, torch.Tensor]  # the collated batch (keys as in dflash_fast.data.batches)
    teacher: Teacher  # the main loss's teacher side (LiLiCorr's distractor penalty reads `last`)


class FamilyTerms(NamedTuple):
    """A family's part of the training forward: its loss term (None: none), the draft [R*A*B] the metrics score,
    and its DrafterOutput fields by name."""

    loss: Optional[torch.Tensor]
    draft: torch.Tensor
    fields: Dict[str, torch.Tensor]


class DFlashDrafter(nn.Module):
    """Trainable: fc, hidden_norm, layers, norm (and a family's own modules: DSpark's markov_head, confidence_head;
    DFlash2's convolutions in the layers and candidate_selector). Frozen buffers: embed_tokens, lm_head, target_norm.
    """

    family = "dflash"
    families: Dict[str, type] = {}  # family name -> its class, filled as each family's module is imported

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        DFlashDrafter.families[cls.family] = cls

    def __new__(cls, cfg: Optional[DrafterConfig] = None, *_args, **_kwargs):
        """DFlashDrafter(cfg) is an instance of the family class `cfg.family` names."""
        if cls is DFlashDrafter and cfg is not None and cfg.family != cls.family:
            if cfg.family not in DFlashDrafter.families:
                raise ValueError(f"drafter family {cfg.family!r} is not loaded: import dflash_fast.drafter.families "
                                 "(dflash_fast.drafter.model does), which imports every family")
            cls = DFlashDrafter.families[cfg.family]
        return super().__new__(cls)

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
        self.add_heads()
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
        """hidden [R, T, K, H_t] -> ctx [R, T, H] = hidden_norm(fc(concat_k hidden)) (spec.md §3)."""
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

    def batch_states(self, batch: Dict[str, torch.Tensor], noise_std: float = 0.0, seed: int = 0,
                     ctx: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Pre-norm block states [R, A*B, H] of a collated batch (keys as in dflash_fast.data.batches): the context
        from the tapped hidden states (or `ctx` given), then the N layers over every anchor's block."""
        anchors = batch["anchors"]
        return self.block_states(
            self.context(batch["hidden"], noise_std, seed) if ctx is None else ctx,
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
        **family_weights: float,
    ) -> DrafterOutput:
        """Training forward on a collated batch (keys as in dflash_fast.data.batches).

        weighting: "decay" (spec.md §5 position weights with `gamma`) or "dpace" (D-PACE with `dpace_alpha`,
        computed inside the loss from the drafter's confidence). family_weights: the weights of the families' loss
        terms by name (confidence_alpha: DSpark's, spec.md §8; selector_alpha: DFlash2's, spec.md §9; lilicorr_w_ce,
        _w_margin, _margin, _w_pen: LiLiCorr's), each read by its family's `family_terms`, the others ignored.
        """
        cfg = self.config
        anchors = batch["anchors"]
        r, a = anchors.shape
        b = cfg.block_size
        ctx = self.context(batch["hidden"], noise_std, seed)
        x = self.batch_states(batch, ctx=ctx)
        targets = slot_targets(batch, b, cfg.sample_from_anchor)
        dpace = DPace(dpace_alpha, b) if weighting == "dpace" else None
        decay = position_weights(b, gamma, cfg.sample_from_anchor).to(x.device) * targets.slot_mask
        weights = targets.slot_mask.float() if dpace else decay
        n = r * a * b
        teacher, stored_argmax = slot_teacher(batch, targets, loss_kind, self.target_norm, x.dtype)
        step = Step(x, targets, gather_rows(batch["input_ids"], targets.prev_position), weights.reshape(n), decay,
                    dpace, loss_kind, ctx, batch, teacher)
        head_options, state = self.loss_head(step)
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
            **head_options,
        )
        teacher_argmax = stored_argmax if stored_argmax is not None and loss_kind == "ce_data" else out.teacher_argmax
        terms = self.family_terms(step, out, teacher_argmax, state, family_weights)
        loss = out.loss if terms.loss is None else out.loss + terms.loss
        return DrafterOutput(loss, out.kl, terms.draft.view(r, a, b), teacher_argmax.view(r, a, b),
                             targets.slot_mask, out.alpha.view(r, a, b), cfg.first_slot, **terms.fields)

    # ---------------------------------------------------------------- the family hooks (DFlash: none of its own)

    def add_heads(self) -> None:
        """Build the family's own modules from self.config (DFlash: none)."""

    def loss_head(self, step: Step) -> Tuple[Dict[str, Any], Any]:  # noqa: ARG002 (a hook: DFlash reads nothing)
        """The family's extra keyword arguments of ops.lm_head_loss (markov=, topk=) and the state its
        `family_terms` reads (DFlash: none)."""
        return {}, None

    def family_terms(self, step: Step, out: LossOutput, teacher_argmax: torch.Tensor, state: Any,  # noqa: ARG002
                     weights: Dict[str, float]) -> FamilyTerms:  # noqa: ARG002
        """The family's loss term, the draft the metrics score and its DrafterOutput fields (DFlash: no term, the
        argmax of the logits)."""
        return FamilyTerms(None, out.draft_argmax, {})

    def logits_with_heads(self, batch: Dict[str, torch.Tensor], x: torch.Tensor,  # noqa: ARG002
                          logits: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The export gate's logits [R, A*B, V] with the family's heads applied, and its confidence logits
        [R*A*B] or None (DFlash: the logits as they are)."""
        return logits, None

    def walk(self, x: torch.Tensor, hidden: torch.Tensor, logits: torch.Tensor, anchor_token: int,  # noqa: ARG002
             draw=None, with_confidence: bool = False,  # noqa: ARG002
             context: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:  # noqa: ARG002
        """The proposal of one block from its pre-norm states x [B, H], normed states hidden [B, H] and logits
        [B, V] -> (the drafted tokens, each one's acceptance probability [same length] or None); context [T, H]: the
        sequence's ctx rows (positions 0..T-1). DFlash: every drafted slot's logits through `draw` at once (default
        argmax)."""
        return (draw or _argmax)(logits[self.config.first_slot:]), None

    def gate_outputs(self, batch: Dict[str, torch.Tensor],  # noqa: ARG002 (a hook: DFlash adds nothing)
                     logits: torch.Tensor) -> Dict[str, torch.Tensor]:  # noqa: ARG002
        """What the export gate compares beside the logits, by name, on the one-row gate batch: the family's own
        outputs, given the reference drafter's fp32 logits [1, A*B, V(+1)] to choose from (DFlash: nothing)."""
        return {}

    @property
    def proposes_confidence(self) -> bool:
        """`propose(..., with_confidence=True)` gives an acceptance probability per guess (a DSpark confidence
        head)."""
        return False

    def block_logits(self, batch: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Materialised fp32 logits of every slot [R, A*B, V], Markov bias (from the ground-truth previous tokens)
        included, and the confidence logits [R, A*B] or None: for the export gate, not for training."""
        x = self.batch_states(batch)
        logits, confidence = self.logits_with_heads(batch, x, F.linear(self.norm(x), self.lm_head.to(x.dtype)))
        return logits.float(), None if confidence is None else confidence.float().view(x.shape[:2])

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, anchor_token: int, with_confidence: bool = False, draw=None):
        """Inference for one sequence: hidden [T, K, H_t] of positions 0..T-1 (all the target has
        processed), anchor token at position T -> greedy guesses for positions T+1..T+B-1 [B-1]
        (T+1..T+B [B] with sample_from_anchor), drafted by the family's `walk` (DSpark's Markov head and
        DFlash2's selector draft slot by slot, each slot from the token drafted for the position before its own).
        with_confidence (a drafter with a confidence head, `proposes_confidence`): (guesses, the head's acceptance
        probability of each guess [same length]). draw: logits [n, V] -> tokens [n] (default argmax), every
        drafted slot's token picked through it (sampling.DraftSampler samples them)."""
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
        if with_confidence and not self.proposes_confidence:
            raise ValueError("with_confidence: this drafter has no confidence head (model.confidence_head)")
        guesses, confidence = self.walk(x[0], hidden_normed, logits, anchor_token, draw, with_confidence, ctx[0])
        return (guesses, confidence) if with_confidence else guesses

def _argmax(slot_logits: torch.Tensor) -> torch.Tensor:
    """The greedy draw of `propose`: logits [n, V] -> tokens [n]."""
    return slot_logits.argmax(-1)
