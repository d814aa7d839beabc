"""Every loss kind scores slot j of the block at anchor a against the teacher at a + j - 1 (spec.md §5).

The batch's teacher is recognisable: at row r, position t, the stored top-1 id is `teacher_id(r, t)`,
and `last[r, t]` is built so that lm_head(final_norm(last)) has that same argmax. The data tokens
`input_ids[r, t] = data_token(r, t)` are distinct too. The expected loss is written slot by slot
from spec.md (tests/oracles.py: no slot_targets, no gather_rows): a slot reading its teacher one
position off, or the data label one position off, changes the number.
"""
import pytest
import torch
from oracles import (
    drafter_logits,
    hard_cross_entropy,
    position_weight,
    slot_kl,
    slot_loss,
    slot_mask,
    teacher_logits,
    trained_slots,
)
from test_drafter import B, H, K, V, small_config

from dflash_fast.drafter.model import DFlashDrafter, slot_metrics

T, TOPK = 30, 5
EPS = 1e-6
GAMMA = 3.0  # not the default 7: the weights must come from the gamma passed in
MASK_TOKEN = V - 1  # small_config's

# Two rows of T = 30 tokens: (document lengths, positions with loss_mask 0, anchors, anchor_valid).
# The anchors reach a document's end (slots in the next document), a masked position, the row's end
# (slots past T); each row ends with an invalid anchor repeating its last valid one, as batches.py writes them.
ROWS = (
    ([12, 18], [0, 1, 7, 20], [2, 5, 10, 16, 18, 26, 27, 27], [1, 1, 1, 1, 1, 1, 1, 0]),
    ([7, 9, 14], [0, 1, 2, 8, 16], [3, 5, 9, 13, 17, 24, 28, 28], [1, 1, 1, 1, 1, 1, 1, 0]),
)


def teacher_id(r: int, t: int) -> int:
    """The target's argmax at row r, position t (its guess for t + 1): distinct within a row."""
    return (t + 37 * r) % V


def data_token(r: int, t: int) -> int:
    """The dataset token at row r, position t: distinct within a row, never the mask token."""
    return (2 * t + 5 + r) % MASK_TOKEN


def make_drafter() -> DFlashDrafter:
    """The drafter tests' small drafter (V = 96, H = 32, K = 3, B = 4, 2 layers) with a recognisable lm_head."""
    torch.manual_seed(0)
    d = DFlashDrafter(small_config())
    d.reset_parameters(std=0.2)
    lm_head = torch.randn(V, H)
    lm_head = 1.5 * lm_head / lm_head.norm(dim=1, keepdim=True)  # equal row norms: last[t] below picks its argmax
    d.set_frozen(torch.randn(V, H), lm_head, 1 + 0.2 * torch.rand(H))
    return d.eval()


def make_batch(d: DFlashDrafter, rows=ROWS):
    gen = torch.Generator().manual_seed(1)
    r_count = len(rows)
    batch = dict(
        input_ids=torch.tensor([[data_token(r, t) for t in range(T)] for r in range(r_count)]),
        loss_mask=torch.ones(r_count, T, dtype=torch.bool),
        document_ids=torch.zeros(r_count, T, dtype=torch.long),
        position_ids=torch.zeros(r_count, T, dtype=torch.long),
        hidden=torch.randn(r_count, T, K, H, generator=gen),
        last=torch.zeros(r_count, T, H),
        anchors=torch.tensor([anchors for _, _, anchors, _ in rows]),
        anchor_valid=torch.tensor([valid for _, _, _, valid in rows], dtype=torch.bool),
    )
    for r, (lengths, unmasked, _, _) in enumerate(rows):
        start = 0
        for doc, n in enumerate(lengths):
            batch["document_ids"][r, start : start + n] = doc
            batch["position_ids"][r, start : start + n] = torch.arange(n)
            start += n
        batch["loss_mask"][r, unmasked] = False
        for t in range(T):
            # final_norm(last) points along lm_head[teacher_id]: that row wins the argmax.
            direction = d.lm_head[teacher_id(r, t)] / d.target_norm
            batch["last"][r, t] = direction + 0.05 * torch.randn(H, generator=gen)
    logits = torch.stack(
        [
            torch.stack([teacher_logits(batch["last"][r, t], d.target_norm, d.lm_head, EPS) for t in range(T)])
            for r in range(r_count)
        ]
    ).float()
    top = logits.topk(TOPK, dim=-1)
    batch.update(teacher_topk_ids=top.indices, teacher_topk_logits=top.values, teacher_lse=logits.logsumexp(-1))
    return batch


# loss kind, batch keys left out (a `ce` batch without the stored teacher must use `last`, one without
# `last` the stored labels), the label each trained slot at position p of row r must be scored against.
STORED_TEACHER = ("teacher_topk_ids", "teacher_topk_logits", "teacher_lse")
KINDS = {
    "kl": ("kl", (), lambda r, p: teacher_id(r, p - 1)),
    "ce-from-last": ("ce", STORED_TEACHER, lambda r, p: teacher_id(r, p - 1)),
    "ce-stored-labels": ("ce", ("last",), lambda r, p: teacher_id(r, p - 1)),
    "ce_data": ("ce_data", ("last",), lambda r, p: data_token(r, p)),
    "kl_topk": ("kl_topk", ("last",), lambda r, p: teacher_id(r, p - 1)),
}


@pytest.fixture(scope="module")
def drafter_and_batch():
    d = make_drafter()
    batch = make_batch(d)
    for r in range(len(ROWS)):
        for t in range(T):  # the recognisable teacher really is what the target computes from `last`
            assert int(teacher_logits(batch["last"][r, t], d.target_norm, d.lm_head, EPS).argmax()) == teacher_id(r, t)
            assert int(batch["teacher_topk_ids"][r, t, 0]) == teacher_id(r, t)
    return d, batch


@pytest.mark.parametrize("name", list(KINDS))
def test_each_loss_kind_reads_the_teacher_at_p_minus_1(drafter_and_batch, name):
    d, full = drafter_and_batch
    kind, dropped, label_of = KINDS[name]
    batch = {k: v for k, v in full.items() if k not in dropped}
    with torch.no_grad():
        out = d(batch, loss_kind=kind, gamma=GAMMA)
        logits = drafter_logits(d, batch, EPS)

    slots = list(trained_slots(batch, B))
    assert len(slots) == 32  # counted by hand from ROWS: 16 in row 0, 16 in row 1
    assert torch.equal(out.slot_mask, slot_mask(batch, B))
    loss = kl = 0.0
    for r, i, j, p in slots:
        slot = (batch, r, p, logits[r, i * B + j], d.target_norm, d.lm_head, EPS)
        if kind in ("ce", "ce_data"):  # the recognisable label itself: teacher_id(r, p - 1), data_token(r, p)
            loss += position_weight(j, GAMMA) * hard_cross_entropy(label_of(r, p), logits[r, i * B + j])
        else:
            loss += position_weight(j, GAMMA) * slot_loss(kind, *slot)
            kl += position_weight(j, GAMMA) * slot_kl(kind, *slot)
        # What the metrics compare the drafter with: the teacher's argmax at p - 1, whatever the loss kind.
        assert int(out.teacher_argmax[r, i, j]) == teacher_id(r, p - 1), f"{name}: row {r} block {i} slot {j} (p={p})"
    torch.testing.assert_close(out.loss.double(), loss / len(slots), rtol=1e-5, atol=1e-6)
    if kind in ("kl", "kl_topk"):
        torch.testing.assert_close(out.kl.double(), kl / len(slots), rtol=1e-4, atol=1e-6)
    else:
        assert out.kl is None


def without_anchor_columns(batch, columns):
    keep = [c for c in range(batch["anchors"].shape[1]) if c not in columns]
    return dict(batch, anchors=batch["anchors"][:, keep], anchor_valid=batch["anchor_valid"][:, keep])


def with_invalid_anchors(batch, extra):
    """`extra` more invalid anchors per row, each repeating the row's last anchor (as batches.py pads)."""
    anchors, valid = batch["anchors"], batch["anchor_valid"]
    repeat = anchors[:, -1:].expand(-1, extra)
    return dict(
        batch,
        anchors=torch.cat([anchors, repeat], 1),
        anchor_valid=torch.cat([valid, torch.zeros_like(repeat, dtype=torch.bool)], 1),
    )


@pytest.mark.parametrize("name", list(KINDS))
def test_invalid_anchors_add_nothing(drafter_and_batch, name):
    d, full = drafter_and_batch
    kind, dropped, _ = KINDS[name]
    full = {k: v for k, v in full.items() if k not in dropped}
    only_valid = without_anchor_columns(full, [7])  # ROWS end with one invalid anchor in column 7
    assert only_valid["anchor_valid"].all()
    with torch.no_grad():
        base = d(only_valid, loss_kind=kind, gamma=GAMMA)
        for batch, invalid in ((full, [7]), (with_invalid_anchors(full, 3), [7, 8, 9, 10])):
            out = d(batch, loss_kind=kind, gamma=GAMMA)
            assert not out.slot_mask[:, invalid].any(), "an invalid anchor's slots are never trained"
            assert int(out.slot_mask.sum()) == int(base.slot_mask.sum()) == 32
            torch.testing.assert_close(out.loss, base.loss, rtol=1e-6, atol=1e-7)
            if base.kl is not None:
                torch.testing.assert_close(out.kl, base.kl, rtol=1e-6, atol=1e-7)
            got, want = slot_metrics(out), slot_metrics(base)
            for key in ("acc_hits", "acc_count", "tau_sum", "blocks"):
                assert torch.equal(got[key], want[key]), key


def test_a_row_without_valid_anchors_adds_nothing(drafter_and_batch):
    """An empty row (validation padding): every anchor invalid at 0, even with loss_mask 1 everywhere."""
    d, _ = drafter_and_batch
    three = make_batch(d, ROWS + (([T], [], [0] * 8, [0] * 8),))
    assert three["loss_mask"][2].all()
    with torch.no_grad():
        out = d(three, loss_kind="kl", gamma=GAMMA)
        base = d({k: v[:2] for k, v in three.items()}, loss_kind="kl", gamma=GAMMA)
    assert not out.slot_mask[2].any() and int(out.slot_mask.sum()) == 32
    torch.testing.assert_close(out.loss, base.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out.kl, base.kl, rtol=1e-6, atol=1e-7)
