"""A NaN or an inf in a stored or streamed hidden state or teacher value (a target that overflowed in fp16, a
damaged store; speculators #994 skips such states at load): the loader drops the piece that holds it, on the CPU
as it reads it (no device sync): its loss mask off, its values zeroed, so no anchor lands in it and nothing else
reads it, and the step's loss stays finite; each drop is counted (the batch's `nonfinite_pieces`, the trainer's
metric of that name). What the rest of the run does with a non-finite loss, gradient or weight: docs/trust.md."""
import pytest
import torch
from test_batches import FakeStore, H, K, all_batches
from test_drafter import random_drafter

from dflash_fast.data.batches import collate_rows
from dflash_fast.train.metrics import Sums

BAD = 3  # the document that holds the bad value


@pytest.mark.parametrize("field, value", [("hidden", float("nan")), ("hidden", float("inf")),
                                          ("last", float("nan")), ("teacher_topk_logits", float("-inf")),
                                          ("teacher_lse", float("nan"))])
def test_a_piece_with_a_nonfinite_value_is_dropped_and_counted(field, value):
    lengths = [20, 9, 14, 11, 17, 8]
    clean, store = FakeStore(lengths, mask_p=1.0), FakeStore(lengths, mask_p=1.0)
    store.items[BAD][field][5] = value
    rows = [[(0, 0, 20), (1, 0, 9)], [(2, 0, 14), (BAD, 0, 11), (4, 0, 6)]]
    fields = {k: (tuple(v.shape[1:]), torch.int64 if k in ("input_ids", "teacher_topk_ids") else
                  torch.bool if k == "loss_mask" else torch.float32) for k, v in store.items[0].items()}
    got, want = (collate_rows(s, rows, [1, 2], 32, 6, fields) for s in (store, clean))
    bad = slice(14, 25)  # row 1, the document's tokens
    assert got["nonfinite_pieces"].tolist() == [0, 1]
    assert not got["loss_mask"][1, bad].any()
    assert all(bool(torch.isfinite(got[k]).all()) for k in fields if got[k].is_floating_point())
    valid = got["anchors"][1][got["anchor_valid"][1]]
    assert not ((valid >= bad.start) & (valid < bad.stop)).any(), "no anchor in the dropped document"
    for k in fields:  # everything else as read from a store without the bad value
        assert torch.equal(got[k][0], want[k][0]) and torch.equal(got[k][1, :bad.start], want[k][1, :bad.start])
        assert torch.equal(got[k][1, bad.stop:], want[k][1, bad.stop:]), k


def test_the_step_stays_finite_and_the_drop_is_a_metric():
    lengths = [30] * 8
    store = FakeStore(lengths, mask_p=1.0)
    store.items[2]["hidden"][7, 1, 0] = float("nan")
    batches = all_batches(store, seq_len=32, num_anchors=4, batch_rows=2, with_last=True)
    d = random_drafter(0, target_hidden_size=H, layer_ids=list(range(K)))
    sums = Sums(4, "cpu")
    for batch in batches:
        b = dict(batch, input_ids=batch["input_ids"] % 95, teacher_topk_ids=batch["teacher_topk_ids"] % 95)
        out = d(b, "ce")
        assert torch.isfinite(out.loss)
        sums.add_output(out, b)
    assert sums.metrics(False)["nonfinite_pieces"] == 1 and sums["nonfinite"] == 0
