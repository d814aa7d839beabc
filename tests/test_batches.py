"""Packing, anchor sampling, sharding and the loader of dflash_fast.data.batches (spec.md §3)."""
import numpy as np
import pytest
import torch

from dflash_fast.data.batches import (
    collate_rows,
    epoch_schedule,
    make_loader,
    pack_rows,
    row_batches,
    row_fields,
    rows_per_epoch,
    sample_anchors,
    split_documents,
    steps_per_epoch,
)
from dflash_fast.data.config import DataConfig

K, H, TOPK = 2, 3, 2


class FakeStore:
    """In-memory stand-in for HiddenStateStore: same duck-typed interface.

    Token t of item i has input_ids = 1000 * i + t + 1 (never the pad id 0) and
    hidden[t, k, h] = the same number + k / 10, so tests can tell where every
    token came from. loss_mask is random with probability `mask_p`.
    """

    def __init__(self, lengths, with_last=True, with_teacher=True, mask_p=0.7, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.manifest = {"schema_version": 1, "num_layers_tapped": K, "hidden_size": H}
        self.accessed = []
        self.items = []
        for i, n in enumerate(self.lengths.tolist()):
            ids = 1000 * i + torch.arange(n, dtype=torch.int32) + 1
            item = {
                "input_ids": ids,
                "loss_mask": (torch.rand(n, generator=gen) < mask_p).to(torch.uint8),
                "hidden": (ids.float()[:, None, None] + torch.arange(K)[None, :, None] / 10)
                .expand(n, K, H)
                .contiguous(),
            }
            if with_last:
                item["last"] = -ids.float()[:, None].expand(n, H).contiguous()
            if with_teacher:
                item["teacher_topk_ids"] = torch.stack([ids, ids + 1], dim=1)
                item["teacher_topk_logits"] = torch.randn(n, TOPK, generator=gen)
                item["teacher_lse"] = torch.randn(n, generator=gen)
            self.items.append(item)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        self.accessed.append(i)
        return self.items[i]


def lengths_for(seed=0, num_docs=60, high=40):
    return np.random.default_rng(seed).integers(1, high, num_docs)


# The data.* keys the batches read (data.split is a dataset's, not the train / val split `split=` names).
DATA_KEYS = ("seq_len", "num_anchors", "batch_rows", "val_fraction", "split_seed", "num_workers")


def data(**kwargs):
    """The data settings of these tests (rows of 32 tokens, 6 anchors, 2 rows a step, no worker), `kwargs` set."""
    return DataConfig(**{**dict(seq_len=32, num_anchors=6, batch_rows=2, num_workers=0), **kwargs})


def all_batches(store, **kwargs):
    """Every batch of one epoch; `kwargs`: data settings (DATA_KEYS) and make_loader's own (seed 3)."""
    settings = {k: v for k, v in kwargs.items() if k in DATA_KEYS}
    args = {"seed": 3, **{k: v for k, v in kwargs.items() if k not in DATA_KEYS}}
    return list(make_loader(store, data(**settings), **args))


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key], y[key]), key


def row_keys(batches):
    """Each row's tokens as a tuple; rows of the fake store are unique by content."""
    return [tuple(row.tolist()) for b in batches for row in b["input_ids"]]


# ---------------------------------------------------------------- anchors


def test_anchors_obey_eligibility_sorted_unique_and_count():
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        t = 40
        loss_mask = torch.rand(t, generator=gen) < 0.6
        document_ids = torch.sort(torch.randint(0, 5, (t,), generator=gen)).values
        num_anchors = int(torch.randint(1, 20, (1,), generator=gen))
        anchors, valid = sample_anchors(loss_mask, document_ids, num_anchors, torch.Generator().manual_seed(trial))
        eligible = {
            a for a in range(t - 1) if loss_mask[a] and loss_mask[a + 1] and document_ids[a] == document_ids[a + 1]
        }
        n = min(num_anchors, len(eligible))
        assert anchors.shape == valid.shape == (num_anchors,)
        assert anchors.dtype == torch.int64 and valid.dtype == torch.bool
        assert valid.tolist() == [True] * n + [False] * (num_anchors - n)
        chosen = anchors[valid].tolist()
        assert set(chosen) <= eligible
        assert len(set(chosen)) == n
        assert torch.all(anchors[1:] >= anchors[:-1]), "anchors (invalid slots included) must stay sorted"
        assert torch.all(anchors[~valid] == (chosen[-1] if n else 0))


def test_anchors_never_cross_documents():
    loss_mask = torch.ones(10, dtype=torch.bool)
    document_ids = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 3, 3])
    anchors, valid = sample_anchors(loss_mask, document_ids, 10, torch.Generator().manual_seed(0))
    # the last token of a document (2, 4, 5) is never an anchor: its next token is another document
    assert anchors[valid].tolist() == [0, 1, 3, 6, 7, 8]


def test_anchor_needs_loss_mask_on_itself_and_next_token():
    loss_mask = torch.tensor([1, 1, 0, 1, 1, 1, 0, 0, 1, 1])
    # More anchor slots than eligible positions: every eligible one is drawn, so a draw cannot hide an extra one.
    anchors, valid = sample_anchors(loss_mask, torch.zeros(10, dtype=torch.int64), 8, torch.Generator().manual_seed(0))
    assert anchors[valid].tolist() == [0, 3, 4, 8]


def test_anchor_sampling_is_uniform_over_eligible_positions():
    t, num_anchors, trials = 30, 5, 2000
    loss_mask = torch.ones(t, dtype=torch.bool)
    loss_mask[10:14] = False
    document_ids = torch.zeros(t, dtype=torch.int64)
    eligible = [a for a in range(t - 1) if loss_mask[a] and loss_mask[a + 1]]
    counts = torch.zeros(t)
    for seed in range(trials):
        anchors, valid = sample_anchors(loss_mask, document_ids, num_anchors, torch.Generator().manual_seed(seed))
        counts[anchors[valid]] += 1
    expected = trials * num_anchors / len(eligible)
    assert counts.nonzero().flatten().tolist() == eligible
    assert torch.all((counts[eligible] - expected).abs() < 0.2 * expected), counts[eligible]


def test_row_without_eligible_positions_has_only_invalid_anchors():
    anchors, valid = sample_anchors(
        torch.zeros(8, dtype=torch.bool), torch.zeros(8, dtype=torch.int64), 3, torch.Generator().manual_seed(0)
    )
    assert not valid.any() and anchors.tolist() == [0, 0, 0]


# ---------------------------------------------------------------- packing


def test_packing_keeps_short_documents_whole_and_cuts_long_ones():
    seq_len = 16
    lengths = [3, 16, 40, 15, 1, 0, 33, 8, 8, 2, 17]
    rows = pack_rows(lengths, seq_len, seed=1)
    pieces = {}
    for row in rows:
        assert 0 < sum(e - s for _, s, e in row) <= seq_len
        for item, s, e in row:
            pieces.setdefault(item, []).append((s, e))
    for item, n in enumerate(lengths):
        got = sorted(pieces.get(item, []))
        if n <= seq_len:
            assert got == ([(0, n)] if n else []), f"document {item} of {n} tokens was split"
        else:
            assert got == [(s, min(s + seq_len, n)) for s in range(0, n, seq_len)], f"document {item} cut wrongly"


def test_packing_is_deterministic_and_seeded():
    lengths = lengths_for(num_docs=200)
    assert pack_rows(lengths, 64, seed=5) == pack_rows(lengths, 64, seed=5)
    assert pack_rows(lengths, 64, seed=5) != pack_rows(lengths, 64, seed=6)


def test_packing_fills_rows():
    lengths = lengths_for(num_docs=400, high=200)
    rows = pack_rows(lengths, 256, seed=0)
    assert sum(lengths) / (len(rows) * 256) > 0.95


def test_collated_rows_hold_the_right_tokens_with_restarting_positions():
    seq_len = 16
    lengths = [5, 40, 7, 12, 3]
    store = FakeStore(lengths)
    rows = pack_rows(lengths, seq_len, seed=0)
    batch = collate_rows(store, rows, list(range(len(rows))), seq_len, 4, row_fields(store, with_last=True))
    for r, row in enumerate(rows):
        offset = 0
        for doc, (item, s, e) in enumerate(row):
            span = slice(offset, offset + e - s)
            src = store.items[item]
            assert torch.equal(batch["input_ids"][r, span], src["input_ids"][s:e].long())
            assert torch.equal(batch["loss_mask"][r, span], src["loss_mask"][s:e].bool())
            assert torch.equal(batch["hidden"][r, span], src["hidden"][s:e])
            assert torch.equal(batch["last"][r, span], src["last"][s:e])
            assert torch.equal(batch["teacher_topk_ids"][r, span], src["teacher_topk_ids"][s:e].long())
            assert torch.equal(batch["teacher_lse"][r, span], src["teacher_lse"][s:e])
            assert batch["position_ids"][r, span].tolist() == list(range(e - s)), "positions restart per document"
            assert torch.all(batch["document_ids"][r, span] == doc)
            offset += e - s
        assert torch.all(batch["position_ids"][r, offset:] == torch.arange(seq_len - offset))


def test_padding_carries_no_loss_mask_and_no_anchor():
    store = FakeStore(lengths_for(num_docs=30, high=20), mask_p=1.0)
    seen_padding = False
    for batch in all_batches(store, seq_len=32, num_anchors=32):
        for r in range(batch["input_ids"].shape[0]):
            pad = batch["input_ids"][r] == 0
            seen_padding |= bool(pad.any())
            assert not batch["loss_mask"][r, pad].any()
            assert torch.all(batch["hidden"][r, pad] == 0)
            pad_docs = batch["document_ids"][r, pad].unique()
            assert pad_docs.numel() <= 1
            if pad_docs.numel():
                assert pad_docs.item() not in batch["document_ids"][r, ~pad].tolist(), "padding is its own document"
            anchors = batch["anchors"][r, batch["anchor_valid"][r]]
            assert not pad[anchors].any() and not pad[anchors + 1].any()
    assert seen_padding


def test_batch_has_exactly_the_contract_keys_shapes_and_dtypes():
    store = FakeStore(lengths_for())
    r, t, a = 2, 32, 6
    batch = all_batches(store, seq_len=t, num_anchors=a, batch_rows=r, with_last=True)[0]
    expected = {
        "input_ids": ((r, t), torch.int64),
        "loss_mask": ((r, t), torch.bool),
        "document_ids": ((r, t), torch.int64),
        "position_ids": ((r, t), torch.int64),
        "hidden": ((r, t, K, H), torch.float32),
        "last": ((r, t, H), torch.float32),
        "teacher_topk_ids": ((r, t, TOPK), torch.int64),
        "teacher_topk_logits": ((r, t, TOPK), torch.float32),
        "teacher_lse": ((r, t), torch.float32),
        "anchors": ((r, a), torch.int64),
        "anchor_valid": ((r, a), torch.bool),
        "nonfinite_pieces": ((r,), torch.int64),
    }
    assert set(batch) == set(expected)
    for key, (shape, dtype) in expected.items():
        assert tuple(batch[key].shape) == shape and batch[key].dtype == dtype, key
    no_last = all_batches(store, seq_len=t, num_anchors=a, batch_rows=r)[0]
    assert set(no_last) == set(expected) - {"last"}
    bare = all_batches(FakeStore(lengths_for(), with_last=False, with_teacher=False), seq_len=t)[0]
    assert set(bare) == set(expected) - {"last", "teacher_topk_ids", "teacher_topk_logits", "teacher_lse"}


def test_requesting_last_from_a_store_without_it_is_an_error():
    with pytest.raises(ValueError, match="no `last`"):
        make_loader(FakeStore([10, 10], with_last=False), data(seq_len=8, num_anchors=2, batch_rows=1), 0,
                    with_last=True)


# ---------------------------------------------------------------- determinism, sharding, resume


def test_same_seed_same_batches_other_seed_other_anchors():
    store = FakeStore(lengths_for())
    a = all_batches(store, seed=3)
    assert_same_batches(a, all_batches(store, seed=3))
    b = all_batches(store, seed=4)
    assert any(not torch.equal(x["anchors"], y["anchors"]) for x, y in zip(a, b))


def test_epochs_reshuffle_rows_and_resample_anchors():
    store = FakeStore(lengths_for())
    e0, e1 = all_batches(store, epoch=0), all_batches(store, epoch=1)
    assert row_keys(e0) != row_keys(e1)
    assert rows_per_epoch(store, data(), 3) == len(pack_rows(store.lengths, 32, 3))


def test_worker_count_does_not_change_batches():
    store = FakeStore(lengths_for())
    assert_same_batches(all_batches(store, num_workers=0), all_batches(store, num_workers=2))


def test_ranks_see_disjoint_equal_shares_of_rows():
    store = FakeStore(lengths_for(num_docs=80))
    world, batch_rows = 3, 2
    per_rank = [row_keys(all_batches(store, batch_rows=batch_rows, rank=r, world_size=world)) for r in range(world)]
    steps = steps_per_epoch(store, data(batch_rows=batch_rows), 3, world_size=world)
    num_rows = rows_per_epoch(store, data(), 3)
    assert steps == num_rows // (world * batch_rows)
    for keys in per_rank:
        assert len(keys) == steps * batch_rows
    flat = [k for keys in per_rank for k in keys]
    assert len(set(flat)) == len(flat), "a row was given to two ranks"


def test_schedule_drops_train_tail_and_pads_val_tail():
    train = np.concatenate([epoch_schedule(11, 2, 0, 0, r, 2, "train").ravel() for r in range(2)])
    assert len(train) == 8 and len(set(train.tolist())) == 8 and train.min() >= 0
    val = np.concatenate([epoch_schedule(11, 2, 0, 0, r, 2, "val").ravel() for r in range(2)])
    assert len(val) == 12 and sorted(val[val >= 0].tolist()) == list(range(11)) and (val == -1).sum() == 1


def _items_of(batches):
    """Store items whose tokens appear in the batches (input_ids encode 1000 * item + t + 1)."""
    return {i for b in batches for i in ((b["input_ids"][b["input_ids"] > 0] - 1) // 1000).tolist()}


def test_resume_at_start_step_matches_uninterrupted_epoch_and_skips_reads():
    store = FakeStore(lengths_for(num_docs=80))
    full = all_batches(store)
    start = 3
    store.accessed.clear()
    resumed = list(make_loader(store, data(), seed=3, start_step=start))
    assert_same_batches(full[start:], resumed)
    # item 0 is opened once for its field shapes and dtypes (views only)
    assert set(store.accessed) - {0} == _items_of(resumed) - {0}, "resuming read documents of skipped rows"


def test_loader_reads_only_the_documents_of_its_rows():
    store = FakeStore(lengths_for(num_docs=80))
    loader = make_loader(store, data(), seed=3)
    store.accessed.clear()
    first = next(iter(loader))
    assert set(store.accessed) == _items_of([first])


def test_a_step_names_the_documents_it_reads_and_collates_from_any_mapping_of_them():
    """What online mode relies on: documents(step) are exactly the items the step reads, and collate(step, docs)
    over a mapping holding only those equals the dataset's own batch."""
    store = FakeStore(lengths_for(num_docs=80))
    dataset = row_batches(store, data(), seed=3, epoch=1)
    for step in (0, len(dataset) - 1):
        store.accessed.clear()
        batch = dataset[step]
        assert dataset.documents(step) == sorted(set(store.accessed))
        docs = {i: store.items[i] for i in dataset.documents(step)}
        assert_same_batches([batch], [dataset.collate(step, docs)])


# ---------------------------------------------------------------- validation split


def test_validation_split_is_by_document_and_deterministic():
    train, val = split_documents(50, 0.2, split_seed=1)
    assert len(val) == 10 and len(train) == 40
    assert set(train.tolist()) | set(val.tolist()) == set(range(50)) and not set(train.tolist()) & set(val.tolist())
    again = split_documents(50, 0.2, split_seed=1)
    assert np.array_equal(again[0], train) and np.array_equal(again[1], val)
    assert not np.array_equal(split_documents(50, 0.2, split_seed=2)[1], val)


def test_val_loader_scores_every_val_document_once_across_ranks_and_never_train_ones():
    store = FakeStore(lengths_for(num_docs=80), mask_p=1.0)
    train_docs, val_docs = split_documents(len(store), 0.25, split_seed=0)
    world = 3
    batches = [
        b
        for r in range(world)
        for b in all_batches(store, split="val", val_fraction=0.25, rank=r, world_size=world, batch_rows=2)
    ]
    tokens = [t for b in batches for t in b["input_ids"][b["input_ids"] > 0].tolist()]
    assert len(tokens) == len(set(tokens)) == int(store.lengths[val_docs].sum())
    assert _items_of(batches) == set(val_docs.tolist())
    train_batches = all_batches(store, val_fraction=0.25)
    assert not _items_of(train_batches) & set(val_docs.tolist())
    empty_rows = [(b, r) for b in batches for r in range(b["input_ids"].shape[0]) if not b["input_ids"][r].any()]
    for b, r in empty_rows:
        assert not b["loss_mask"][r].any() and not b["anchor_valid"][r].any()
    later_epoch = [
        b
        for r in range(world)
        for b in all_batches(
            store, split="val", val_fraction=0.25, rank=r, world_size=world, batch_rows=2, epoch=5, seed=9
        )
    ]
    assert_same_batches(batches, later_epoch)
