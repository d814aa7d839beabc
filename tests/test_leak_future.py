"""Two failures reported against other trainers, tested on every attention path and family here.

* Overlapping blocks leak the future (SpecForge #470): with anchors closer than block_size the blocks overlap, and a
  mask that decides context visibility by block index lets a block see target states at or after its own anchor.
  Here visibility is decided per anchor position (spec.md §4): perturbing every target state at a position >= a
  block's anchor leaves that block's logits, drafts, acceptance estimates and loss unchanged, on the eager and
  Triton paths, with a sliding window ending at the anchor or at each query, for DFlash, DSpark and DFlash2, with a
  block that crosses the packed row's document boundary.
* Anchors at a document boundary in a packed row (speculators #901): the slots of a block that run into the next
  document carry no loss, and a block sees no other document: perturbing everything of the other document (its
  tokens, target states, teacher) leaves the block's loss, drafts and acceptance unchanged, for every loss kind and
  weighting, with DSpark's heads (the Markov predecessor of slot 0 is the anchor's own token) and DFlash2's selector
  (its candidates and their predecessors).

A block's own loss is the loss of the batch with only that anchor valid."""
import pytest
import torch
from test_dflash2 import dflash2_drafter
from test_drafter import B, random_batch, random_drafter
from test_dspark import dspark_drafter

from dflash_fast.drafter import ops
from dflash_fast.drafter.losses import DENSE_KINDS, LOSS_KINDS, WEIGHTINGS
from dflash_fast.drafter.targets import slot_targets

T, BOUNDARY = 24, 13  # document 0 holds positions 0..12, document 1 positions 13..23
DOCS = [[0] * BOUNDARY + [1] * (T - BOUNDARY)]
# Anchors closer than B = 4 (3, 5, 6 overlap), one whose block crosses into document 1 (10: slots at 10..13), one on
# document 1's first token (13), one inside it (15).
ANCHORS = (3, 5, 6, 10, 13, 15)
STATE_FIELDS = ("hidden",)  # what the drafter reads as context: the target's tapped states
EVERY_FIELD = ("input_ids", "hidden", "last", "teacher_topk_ids", "teacher_topk_logits", "teacher_lse")

HEADS = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # the Triton kernel's smallest head dim
FAMILIES = {
    "dflash": lambda: random_drafter(0, **HEADS),
    "window_anchor": lambda: random_drafter(0, num_layers=2, layer_types=["sliding", "full"], sliding_window=6,
                                            **HEADS),
    "window_query": lambda: random_drafter(0, num_layers=2, layer_types=["sliding", "sliding"], sliding_window=6,
                                           window_from="query", **HEADS),
    "dspark": lambda: dspark_drafter(**HEADS),
    "dspark_dflash_alignment": lambda: dspark_drafter(sample_from_anchor=False, **HEADS),
    "dflash2": lambda: dflash2_drafter(**HEADS),
}


def batch_of(valid_anchor=None):
    """The packed row, every anchor valid, or only `valid_anchor`'s (that block's own loss)."""
    valid = tuple(valid_anchor is None or a == valid_anchor for a in ANCHORS)
    return random_batch(seed=3, t=T, anchors=(ANCHORS,), valid=(valid,), docs=DOCS)


def perturbed(batch, positions, fields, seed=11):
    """`batch` with `fields` replaced by other values at `positions` (token ids: other ids; states: other states)."""
    g = torch.Generator().manual_seed(seed)
    out = {k: v.clone() for k, v in batch.items()}
    for f in fields:
        x = out[f][0, positions]
        if f in ("input_ids", "teacher_topk_ids"):
            x = (x + 1 + torch.randint(0, 50, x.shape, generator=g)) % 95
        else:
            x = x + 3 * torch.randn(x.shape, generator=g)
        out[f][0, positions] = x
    return out


def block_view(d, batch, kind, weighting, i, every_slot=True):
    """What block i shows: its rows of block_logits, the loss, and on the slots that train (slot_mask) its drafts,
    acceptance estimates and confidence. A slot that does not train (slot 0, a slot past the document) has an
    estimate against whatever teacher row it points at, which nothing reads: masked out of the loss and every
    metric (slot_metrics). `every_slot`: the logits of every slot (else of the slots that train: a DSpark slot past
    the document reads its Markov predecessor there)."""
    out = d(batch, kind, weighting=weighting, gamma=3.0, dpace_alpha=0.3)
    logits, _ = d.block_logits(batch)
    trains = out.slot_mask[0, i]
    view = {"logits": logits[0, i * B:(i + 1) * B][slice(None) if every_slot else trains], "loss": out.loss,
            "draft": out.draft_argmax[0, i][trains], "alpha": out.alpha[0, i][trains]}
    if out.confidence is not None:
        view["confidence"] = out.confidence.view(out.alpha.shape)[0, i][trains]
    return view


def assert_same(a, b, what):
    for key in ("loss", *a):
        assert torch.allclose(a[key].float(), b[key].float(), atol=1e-5, rtol=1e-5), f"{what}: {key} changed"


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_block_sees_no_target_state_at_or_after_its_anchor(family, backend):
    d = FAMILIES[family]()
    kind = "kl"
    with torch.no_grad(), ops.backend(backend):
        for i, a in enumerate(ANCHORS):
            base = block_view(d, batch_of(a), kind, "decay", i)
            moved = block_view(d, perturbed(batch_of(a), list(range(a, T)), STATE_FIELDS), kind, "decay", i)
            assert_same(base, moved, f"{family}/{backend}: the block at anchor {a} read a state at >= {a}")
            if a - 1 >= (0 if a < BOUNDARY else BOUNDARY):  # the check can fail: a state before the anchor is read
                seen = block_view(d, perturbed(batch_of(a), [a - 1], STATE_FIELDS), kind, "decay", i)
                assert not torch.allclose(seen["logits"], base["logits"]), f"{family}: the context is not read"


def kinds_of(family):
    return DENSE_KINDS if family.startswith("dspark") else LOSS_KINDS  # the confidence head needs a dense teacher


@pytest.mark.parametrize("family", ["dflash", "dspark", "dspark_dflash_alignment", "dflash2"])
def test_a_block_at_a_document_boundary_carries_no_loss_and_sees_no_other_document(family):
    d = FAMILIES[family]()
    crossing, first = ANCHORS.index(10), ANCHORS.index(13)
    mask = slot_targets(batch_of(), B, d.config.sample_from_anchor).slot_mask[0]
    # Slots predicting positions 13.. (document 1) of the block at 10 carry no loss.
    predicted = torch.tensor(ANCHORS)[:, None] + torch.arange(B) + int(d.config.sample_from_anchor)
    assert not (mask & (predicted >= BOUNDARY) & (torch.tensor(ANCHORS)[:, None] < BOUNDARY)).any()
    assert mask[crossing].any() and mask[first].any(), "each block keeps the slots inside its own document"
    with torch.no_grad():
        for kind in kinds_of(family):
            for weighting in WEIGHTINGS:
                for i, other in ((crossing, range(BOUNDARY, T)), (first, range(0, BOUNDARY))):
                    a = ANCHORS[i]
                    base = block_view(d, batch_of(a), kind, weighting, i, every_slot=False)
                    moved = block_view(d, perturbed(batch_of(a), list(other), EVERY_FIELD), kind, weighting, i,
                                       every_slot=False)
                    assert_same(base, moved, f"{family} {kind}/{weighting}: the block at {a} read the other document")
