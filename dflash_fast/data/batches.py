"""Batches: pack store documents into rows of T tokens, sample anchors, collate (spec.md §3).

    store (memmap) ──pack_rows──▶ rows ──epoch_schedule──▶ this rank's steps ──collate_rows──▶ batch dict

A *piece* `(item, start, end)` is tokens `start:end` of store item (document)
`item`; a *row* is a list of pieces holding at most `T` tokens, each piece its
own document in the row. The batch dict, for `R` rows per step and `A` anchors
per row, is the contract the drafter and the trainer consume:

    input_ids           [R, T] int64          pad id (0) after the last piece
    loss_mask           [R, T] bool           0 on padding
    document_ids        [R, T] int64          0, 1, ... per piece; the padding is one more document
    position_ids        [R, T] int64          restart at 0 in every document (and in the padding)
    hidden              [R, T, K, H_t]        store dtype (bf16 from an fp8 store: dequantised here); 0 on padding
    last                [R, T, H_t]           like hidden; only with `with_last=True`
    teacher_topk_ids    [R, T, k] int64       \
    teacher_topk_logits [R, T, k] float32     > each only if the store has it; 0 on padding
    teacher_lse         [R, T]    float32     /
    anchors             [R, A] int64          sorted; the valid slots come first
    anchor_valid        [R, A] bool
    nonfinite_pieces    [R] int64             pieces of the row dropped for a NaN / inf value (below)

Choices, so that the trainer can rely on them:

* Packing is best fit in a seeded shuffled order of the documents (each piece
  goes to the open row with the least room that still fits it), done once per
  split from the token counts alone: every epoch has the same rows, only their
  order changes. Documents longer than `T` are cut into pieces of `T` tokens
  (each fills a row) and a remainder that is packed like a document.
* Anchors of a row depend only on `(seed, epoch, row id)`, never on workers,
  ranks or iteration order. Invalid slots repeat the last valid anchor (0 when
  the row has none), so `anchors` stays sorted and an invalid block never widens
  a kernel tile's context range.
* Data parallelism: the train split is shuffled per epoch and cut to a multiple
  of `world_size * batch_rows` (DROPPED tail, a different one every epoch); rank
  `r` takes every `world_size`-th row from `r`. The val split keeps its order and
  is PADDED with empty rows (no tokens, no valid anchor) so that every val row is
  scored exactly once; empty rows add nothing to a masked loss or its count.
* The val split holds whole documents (`val_fraction` of them, chosen by
  `split_seed`). Its packing and anchors depend only on `split_seed`, not on the
  training `seed` or the epoch, so every validation pass, in every run, scores
  the same batches.
* A piece whose float fields (hidden, last, teacher logits, lse) hold a NaN or an inf (a target that overflowed
  in fp16, a damaged store) is dropped on the CPU as it is read: its float values zeroed, its loss mask off (so
  no anchor lands in it and no slot scores against it; other documents never see it), and counted in
  `nonfinite_pieces` (the trainer's `nonfinite_pieces` metric). One NaN would otherwise turn the step's loss
  and then every weight NaN, and a resumed run would meet it again at the same step. The check reads values
  the collate has just copied, in the loader's worker: no device sync.
* Training noise is not added here: `ops.fc_concat(..., noise_std, seed)` draws
  its own uniform `[-noise_std, noise_std)` noise, so `hidden` leaves the loader
  exactly as stored (and validation simply passes `noise_std=0`).
"""
import bisect
import signal
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from dflash_fast.data.config import DataConfig
from dflash_fast.store.fp8 import FP8_READ_DTYPE, SCALE_FIELDS, dequantize_fp8

Piece = Tuple[int, int, int]
Row = List[Piece]

SPLITS = ("train", "val")
OPTIONAL_FIELDS = ("last", "teacher_topk_ids", "teacher_topk_logits", "teacher_lse")
INT64_FIELDS = ("input_ids", "teacher_topk_ids")  # int32 in a store, int64 in a batch
COMPUTE_DTYPE_FIELDS = ("hidden", "last")  # in the compute dtype on the device (data.to_device); the rest keep theirs

# Distinct streams of randomness: the same (seed, epoch, row) never feeds two of them.
_TAG_PACK, _TAG_SPLIT, _TAG_ORDER, _TAG_ANCHORS, _TAG_VAL_ANCHORS = range(5)


def derive_seed(*entropy: int) -> int:
    """A 64-bit seed from non-negative ints, e.g. (seed, stream, epoch, row); the same on every process."""
    return int(np.random.SeedSequence([int(e) for e in entropy]).generate_state(1, dtype=np.uint64)[0])


def pack_rows(lengths: Sequence[int], seq_len: int, seed: int = 0, items: Optional[Sequence[int]] = None) -> List[Row]:
    """Pack documents into rows of at most `seq_len` tokens, best fit in a seeded shuffled order.

    lengths: [N] tokens per store item; items: the items to pack (default all N).
    Returns rows, each a list of pieces `(item, start, end)`. A document of at most
    `seq_len` tokens is one piece; a longer one is cut at multiples of `seq_len`.
    Empty documents are left out. Deterministic in (lengths, seq_len, seed, items);
    O(N log T) from the lengths alone, without reading any token.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len}: a row needs at least 2 tokens to hold an anchor and its next token")
    lengths = np.asarray(lengths, dtype=np.int64)
    items = np.arange(len(lengths)) if items is None else np.asarray(items, dtype=np.int64)
    order = np.random.default_rng(derive_seed(seed, _TAG_PACK)).permutation(items)
    rows: List[Row] = []
    rooms: List[int] = []  # sorted free-token counts that at least one open row has
    rows_with_room: Dict[int, List[int]] = {}  # free tokens -> open rows with exactly that many
    for item in order.tolist():
        n = int(lengths[item])
        start = 0
        while n - start >= seq_len:
            rows.append([(item, start, start + seq_len)])
            start += seq_len
        size = n - start
        if size == 0:
            continue
        i = bisect.bisect_left(rooms, size)
        if i == len(rooms):
            row, room = len(rows), seq_len
            rows.append([])
        else:
            room = rooms[i]
            row = rows_with_room[room].pop()
            if not rows_with_room[room]:
                del rows_with_room[room]
                rooms.pop(i)
        rows[row].append((item, start, n))
        room -= size
        if room > 0:
            if room not in rows_with_room:
                rows_with_room[room] = []
                bisect.insort(rooms, room)
            rows_with_room[room].append(row)
    return rows


def split_documents(num_docs: int, val_fraction: float, split_seed: int = 0,
                    content: Optional[Sequence[str]] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Hold out whole documents: -> (train items, val items), each sorted int64.

    round(val_fraction * num_docs) documents (at least 1 when val_fraction > 0),
    chosen by a permutation seeded by `split_seed` alone. With `content` (each document's key, the store's
    `content`: its trained tokens' hash) documents that teach the same tokens are one group, held out or kept
    together: a response repeated under two prompts never sits on both sides. The permutation is then of the
    groups, in the order each key first appears, and groups go to val until it holds at least the count; a store
    without keys (written before they were recorded) splits document by document, as it always did.
    """
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must be in [0, 1)")
    n_val = max(int(round(val_fraction * num_docs)), 1 if val_fraction > 0 else 0)
    if n_val >= num_docs and n_val > 0:
        raise ValueError(f"val_fraction={val_fraction} of {num_docs} documents leaves none for training; lower it")
    rng = np.random.default_rng(derive_seed(split_seed, _TAG_SPLIT))
    if content is None:
        perm = rng.permutation(num_docs)
        return np.sort(perm[n_val:]), np.sort(perm[:n_val])
    group_of: Dict[str, int] = {}
    groups = np.array([group_of.setdefault(key, len(group_of)) for key in content], dtype=np.int64)
    sizes = np.bincount(groups, minlength=len(group_of))
    order = rng.permutation(len(group_of))
    held = order[: int(np.searchsorted(np.cumsum(sizes[order]), n_val)) + 1] if n_val else order[:0]
    if sizes[held].sum() >= num_docs:
        raise ValueError(f"val_fraction={val_fraction}: the documents form {len(group_of)} groups of the same "
                         f"content, and holding out whole groups leaves none for training; lower it")
    is_val = np.isin(groups, held)
    return np.flatnonzero(~is_val).astype(np.int64), np.flatnonzero(is_val).astype(np.int64)


def split_rows(
    lengths: Sequence[int],
    seq_len: int,
    seed: int,
    split: str = "train",
    val_fraction: float = 0.0,
    split_seed: int = 0,
    content: Optional[Sequence[str]] = None,
) -> List[Row]:
    """The packed rows of one split: train rows packed with `seed`, val rows with `split_seed`; `content`: see
    split_documents."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")
    train, val = split_documents(len(lengths), val_fraction, split_seed, content)
    if split == "val" and len(val) == 0:
        raise ValueError("split='val' needs val_fraction > 0 (the fraction of documents held out)")
    return (
        pack_rows(lengths, seq_len, seed, train) if split == "train" else pack_rows(lengths, seq_len, split_seed, val)
    )


def epoch_schedule(
    num_rows: int, batch_rows: int, seed: int, epoch: int, rank: int = 0, world_size: int = 1, split: str = "train"
) -> np.ndarray:
    """Row ids of every step of one rank in one epoch: [steps, batch_rows] int64, -1 = an empty row.

    train: a permutation seeded by (seed, epoch), tail dropped to a multiple of
    world_size * batch_rows. val: rows in order, padded with -1 to that multiple.
    Rank r takes positions r, r + world_size, ...: ranks are disjoint and equal.
    """
    per_step = world_size * batch_rows
    if split == "train":
        order = np.random.default_rng(derive_seed(seed, _TAG_ORDER, epoch)).permutation(num_rows)
        order = order[: num_rows // per_step * per_step]
    else:
        order = np.full(-(-num_rows // per_step) * per_step, -1, dtype=np.int64)
        order[:num_rows] = np.arange(num_rows)
    return order[rank::world_size].reshape(-1, batch_rows).astype(np.int64)


def sample_anchors(
    loss_mask: torch.Tensor, document_ids: torch.Tensor, num_anchors: int, generator: torch.Generator
) -> Tuple[torch.Tensor, torch.Tensor]:
    """spec.md §3 anchors of one row: loss_mask [T], document_ids [T] -> anchors [A] int64, anchor_valid [A] bool.

    Eligible a: loss_mask[a] = loss_mask[a+1] = 1 and document_ids[a] = document_ids[a+1]
    (a + 1 < T). min(A, #eligible) of them are drawn uniformly without replacement
    and sorted into slots 0..n-1; slots n..A-1 are invalid and hold the last valid
    anchor (0 when n = 0), which keeps `anchors` sorted.
    """
    m = loss_mask.bool()
    eligible = (m[:-1] & m[1:] & (document_ids[:-1] == document_ids[1:])).nonzero().flatten()
    if eligible.numel() > num_anchors:
        pick = torch.randperm(eligible.numel(), generator=generator)[:num_anchors]
        eligible = eligible[pick].sort().values
    n = eligible.numel()
    anchors = torch.zeros(num_anchors, dtype=torch.int64)
    anchors[:n] = eligible
    if n:
        anchors[n:] = eligible[-1]
    return anchors, torch.arange(num_anchors) < n


def row_fields(store, with_last: bool = False) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """The store's per-token fields in a batch: name -> (trailing shape, batch dtype), from item 0's views.

    input_ids, loss_mask, hidden, then those of OPTIONAL_FIELDS the store has
    (`last` only when with_last); ids become int64, loss_mask bool, fp8 hidden states FP8_READ_DTYPE
    (their scales are no batch field: collate_rows dequantises with them).
    """
    sample = store[0]
    if with_last and "last" not in sample:
        raise ValueError(
            "with_last=True but the store has no `last` (the target's final pre-norm residual): "
            "re-extract with it, or use a loss kind that reads the stored teacher (ce, kl_topk)"
        )
    keys = ["input_ids", "loss_mask", "hidden"] + [
        k for k in OPTIONAL_FIELDS if k in sample and (k != "last" or with_last)
    ]
    fields = {}
    for key in keys:
        x = torch.as_tensor(sample[key])
        dtype = torch.int64 if key in INT64_FIELDS else torch.bool if key == "loss_mask" else x.dtype
        fields[key] = (tuple(x.shape[1:]), FP8_READ_DTYPE if dtype == torch.float8_e4m3fn else dtype)
    return fields


def collate_rows(
    store,
    rows: Sequence[Optional[Row]],
    row_seeds: Sequence[int],
    seq_len: int,
    num_anchors: int,
    fields: Dict[str, Tuple[Tuple[int, ...], torch.dtype]],
    pad_id: int = 0,
) -> Dict[str, torch.Tensor]:
    """Build the batch dict (module docstring) of R = len(rows) rows; None is an empty row.

    row_seeds: [R] anchor seeds; fields: row_fields(store, ...). Reads only the
    pieces' token slices of the store's (memory-mapped) items, straight into the
    batch tensors: no per-row copy, no stacking.
    """
    r, t = len(rows), seq_len
    batch = {key: torch.empty((r, t) + shape, dtype=dtype) for key, (shape, dtype) in fields.items()}
    batch["document_ids"] = torch.empty((r, t), dtype=torch.int64)
    batch["position_ids"] = torch.empty((r, t), dtype=torch.int64)
    batch["anchors"] = torch.zeros((r, num_anchors), dtype=torch.int64)
    batch["anchor_valid"] = torch.zeros((r, num_anchors), dtype=torch.bool)
    batch["nonfinite_pieces"] = torch.zeros(r, dtype=torch.int64)
    floats = [key for key in fields if batch[key].is_floating_point()]
    positions = torch.arange(t)
    for i, (row, row_seed) in enumerate(zip(rows, row_seeds)):
        row = row or []
        offset = 0
        for doc, (item, start, end) in enumerate(row):
            n = end - start
            if offset + n > t:
                raise ValueError(
                    f"row {i} holds more than seq_len={t} tokens: pack it with pack_rows(..., seq_len={t})"
                )
            src = store[item]
            for key in fields:
                part = torch.as_tensor(src[key][start:end])
                if part.dtype == torch.float8_e4m3fn:
                    part = dequantize_fp8(part, src[SCALE_FIELDS[key]][start:end], batch[key].dtype)
                batch[key][i, offset : offset + n] = part
            # One fp32 sum a field: NaN or inf anywhere makes it non-finite; half the time of isfinite().all().
            if not all(bool(torch.isfinite(batch[key][i, offset : offset + n].sum(dtype=torch.float32)))
                       for key in floats):
                for key in floats:
                    batch[key][i, offset : offset + n] = 0
                batch["loss_mask"][i, offset : offset + n] = False
                batch["nonfinite_pieces"][i] += 1
            batch["document_ids"][i, offset : offset + n] = doc
            batch["position_ids"][i, offset : offset + n] = positions[:n]
            offset += n
        for key in fields:
            batch[key][i, offset:] = pad_id if key == "input_ids" else 0
        batch["document_ids"][i, offset:] = len(row)
        batch["position_ids"][i, offset:] = positions[: t - offset]
        if row:
            gen = torch.Generator().manual_seed(row_seed)
            batch["anchors"][i], batch["anchor_valid"][i] = sample_anchors(
                batch["loss_mask"][i], batch["document_ids"][i], num_anchors, gen
            )
    return batch


class RowBatches(Dataset):
    """The steps of one rank in one epoch: item s -> batch dict of schedule[s] (see collate_rows).

    rows: all packed rows of the split; schedule: [steps, R] row ids (-1 = empty row); data: the row shape
    (data.seq_len T, data.num_anchors A); anchor_seed_prefix: (seed, stream[, epoch]) — a row's anchor seed is
    derive_seed(*prefix, row id), so it does not depend on who loads the row or when.
    """

    def __init__(
        self,
        store,
        rows: List[Row],
        schedule: np.ndarray,
        data: DataConfig,
        anchor_seed_prefix: Tuple[int, ...],
        with_last: bool = False,
        pad_id: int = 0,
    ):
        self.store, self.rows, self.schedule = store, rows, schedule
        self.seq_len, self.num_anchors = data.seq_len, data.num_anchors
        self.anchor_seed_prefix, self.pad_id = anchor_seed_prefix, pad_id
        self.fields = row_fields(store, with_last)

    def __len__(self) -> int:
        return len(self.schedule)

    def documents(self, step: int) -> List[int]:
        """The store items (documents) the rows of `step` read, sorted."""
        return sorted({item for i in self.schedule[step].tolist() if i >= 0 for item, _, _ in self.rows[i]})

    def collate(self, step: int, store=None) -> Dict[str, torch.Tensor]:
        """The batch dict of `step`, its documents read from `store` (default: the dataset's; any mapping
        item -> per-token fields that holds `documents(step)` will do)."""
        ids = self.schedule[step].tolist()
        rows = [self.rows[i] if i >= 0 else None for i in ids]
        seeds = [derive_seed(*self.anchor_seed_prefix, i) if i >= 0 else 0 for i in ids]
        store = self.store if store is None else store
        return collate_rows(store, rows, seeds, self.seq_len, self.num_anchors, self.fields, self.pad_id)

    def __getitem__(self, step: int) -> Dict[str, torch.Tensor]:
        return self.collate(step)


def _check(
    seq_len: int, num_anchors: int, batch_rows: int, seed: int, rank: int, world_size: int, epoch: int, split: str
):
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len}: a row needs at least 2 tokens to hold an anchor and its next token")
    if num_anchors < 1 or batch_rows < 1:
        raise ValueError(f"num_anchors={num_anchors} and batch_rows={batch_rows} must be >= 1")
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed={seed} and epoch={epoch} must be >= 0")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")


def content_of(store) -> Optional[Sequence[str]]:
    """The store's per-document content keys (store/reader.py), or None: an older store, an online source."""
    return getattr(store, "content", None)


def rows_per_epoch(store, data: DataConfig, seed: int, split: str = "train") -> int:
    """Packed rows in the split (data.seq_len, data.val_fraction, data.split_seed), all ranks together (from the
    token counts only; no token is read)."""
    return len(split_rows(store.lengths, data.seq_len, seed, split, data.val_fraction, data.split_seed,
                          content_of(store)))


def steps_per_epoch(store, data: DataConfig, seed: int, world_size: int = 1, split: str = "train") -> int:
    """Steps each rank takes per epoch (train drops the tail, val pads it); the same every epoch."""
    _check(data.seq_len, 1, data.batch_rows, seed, 0, world_size, 0, split)
    num_rows = rows_per_epoch(store, data, seed, split)
    return len(epoch_schedule(num_rows, data.batch_rows, seed, 0, 0, world_size, split))


def leave_signals_to_the_main_process(_worker_id: int) -> None:
    """DataLoader worker init: ignore SIGTERM/SIGINT. A launcher or scheduler signals the whole process
    tree; torch's worker handler would die on it mid-step, while the main process wants to finish the step,
    save and then shut its workers down."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def row_batches(
    store,
    data: DataConfig,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    epoch: int = 0,
    split: str = "train",
    start_step: int = 0,
    with_last: bool = False,
    pad_id: int = 0,
) -> RowBatches:
    """This rank's steps of one epoch from `start_step` on, as a RowBatches dataset (make_loader wraps it in a
    DataLoader). data: the batch shape and split (data.seq_len, num_anchors, batch_rows, val_fraction,
    split_seed); the rest is the run's: its seed, this rank, the epoch, which split, where a resume starts."""
    seq_len, batch_rows = data.seq_len, data.batch_rows
    _check(seq_len, data.num_anchors, batch_rows, seed, rank, world_size, epoch, split)
    rows = split_rows(store.lengths, seq_len, seed, split, data.val_fraction, data.split_seed, content_of(store))
    schedule = epoch_schedule(len(rows), batch_rows, seed, epoch, rank, world_size, split)
    if len(schedule) == 0:
        raise ValueError(
            f"the {split} split packs into {len(rows)} rows of {seq_len} tokens, fewer than "
            f"world_size * batch_rows = {world_size * batch_rows}: lower batch_rows or seq_len, or add data"
        )
    if not 0 <= start_step <= len(schedule):
        raise ValueError(f"start_step={start_step} is outside the epoch's {len(schedule)} steps")
    prefix = (seed, _TAG_ANCHORS, epoch) if split == "train" else (data.split_seed, _TAG_VAL_ANCHORS)
    return RowBatches(store, rows, schedule[start_step:], data, prefix, with_last, pad_id)


def make_loader(store, data: DataConfig, *args, pin_memory: Optional[bool] = None, **kwargs) -> DataLoader:
    """A DataLoader over this rank's steps of one epoch, from `start_step` on; each item is a batch dict.
    data, args, kwargs: those of `row_batches` (data; seed, rank, world_size, epoch, split, start_step, with_last,
    pad_id); data.num_workers: the loader's worker processes.

    store: HiddenStateStore-like (`lengths`, `__getitem__` -> per-token tensors).
    Skipped steps are never loaded, so resuming at `start_step` costs nothing and
    yields exactly the batches an uninterrupted epoch yields from that step.
    pin_memory: None -> True only when CUDA is available. Use the same
    `data.val_fraction` and `data.split_seed` for the train and the val loader.
    With data.num_workers > 0 the store is shared with the workers (fork) or pickled
    (spawn/forkserver): the store must pickle without copying its files.
    """
    return DataLoader(
        row_batches(store, data, *args, **kwargs),
        batch_size=None,
        shuffle=False,
        num_workers=data.num_workers,
        worker_init_fn=leave_signals_to_the_main_process if data.num_workers else None,
        pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory,
    )
