"""Where every slot's teacher lives (spec.md §5; §8 for `sample_from_anchor`): the slot a block position trains,
the position it predicts, the teacher row at that position - 1, the previous token a family head reads, and what
each loss kind scores the slot against. Shared by every drafter family, the export gate and the tests.
"""
from typing import Dict, NamedTuple, Optional, Tuple

import torch

from dflash_fast.drafter.losses import Teacher, needs_last


def position_weights(block_size: int, gamma: float, sample_from_anchor: bool = False) -> torch.Tensor:
    """spec.md §5: w_0 = 0, w_j = exp(-(j - 1) / gamma) -> [B]; with sample_from_anchor (spec.md §8) every slot
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
    """spec.md §5: slot j of the block at anchor a sits at p = a + j, predicts the token at p and is scored against
    the teacher at p - 1; slot 0 (the given token) never trains. With sample_from_anchor (spec.md §8) slot j
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
    """What every slot is scored against for `loss_kind` (spec.md §5: the teacher at the predicted position - 1;
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
