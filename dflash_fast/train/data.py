"""The training job's data: where the hidden states come from, each rank's batches of one split, and the endless
stream of training micro-batches a resume continues exactly.

    open_source    data.source=store: the store at data.store; online (vllm): the target run over data.jsonl in
                   this process by transformers (by vLLM), or by `dflash-fast serve-target` at
                   data.online.address (an OnlineSource, read like a store)
    planned_manifest  the store's layout the extraction settings give, from the target's config alone (--plan)
    open_batches   one epoch of one split (train / val) for this rank: a DataLoader over the store, or online an
                   OnlineBatches (the target forward one micro-batch ahead)
    TrainStream    the training micro-batches, epoch after epoch, from a (epoch, micro-batch) position
    data_identity  what must not change between a checkpoint and its resume for that position to line up
    to_device      a batch on the device, its hidden states in the compute dtype
"""
from typing import Dict, List, Optional, Tuple

import torch

from dflash_fast.data.batches import COMPUTE_DTYPE_FIELDS, make_loader, row_batches, steps_per_epoch
from dflash_fast.data.online import OnlineBatches, OnlineSource
from dflash_fast.data.source import Source
from dflash_fast.drafter.losses import needs_last
from dflash_fast.drafter.targets import slot_targets
from dflash_fast.errors import ConfigError, UserError
from dflash_fast.extract.plan import ExtractOptions, plan_job
from dflash_fast.store.reader import HiddenStateStore
from dflash_fast.train.config import TrainConfig


def open_source(cfg: TrainConfig):
    """The hidden states: the store at data.store, or with data.source=online the target run over data.jsonl
    in this process (an OnlineSource, read like a store)."""
    d, source = cfg.data, Source.of(cfg.data)
    if source.reads_store:
        return HiddenStateStore(d.store)
    n = d.online
    if source.vllm_in_process and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        raise UserError("data.source=vllm runs one vLLM engine inside a one-rank trainer; with several ranks serve "
                        "the target (`dflash-fast serve-target --engine vllm`, data.online.address=HOST:PORT) or "
                        "extract a store with `dflash-fast extract --engine vllm` (data.source=store)")
    try:
        return OnlineSource(cfg.model.target, d.jsonl, extraction_options(cfg), address=n.address,
                            served=source.replicas(d))
    except (OSError, ValueError) as e:  # bad data or a missing file: exit 1, with the keys that named them
        raise ValueError(f"{source} over data.jsonl={d.jsonl} with model.target={cfg.model.target}: "
                         f"{e}") from None


def extraction_options(cfg: TrainConfig) -> ExtractOptions:
    """The extraction an online source runs, and a store not yet extracted is planned with: data.online's
    extraction settings (ExtractSettings: max_seq_len, batch_tokens, dtype, topk, ...), and the options the run
    decides: model.layer_ids (None: the default spread), `last` unless the loss kind reads none, the source's
    engine, the records data.* reads."""
    d = cfg.data
    return ExtractOptions(
        **d.online.settings(),
        layer_ids=cfg.model.layer_ids,
        # auto is kl when `last` exists; ce reads the top-k argmax the online source computes too
        no_last=not (cfg.loss.kind == "auto" or needs_last(cfg.loss.kind, stored_labels=True)),
        engine=Source.of(d).engine or "hf",
        split=d.split,
        max_samples=d.max_samples or None,
        reasoning=d.reasoning,
    )


def planned_manifest(cfg: TrainConfig) -> Dict:
    """What a plan reads of a manifest (layer ids, the Layout's fields, the target's path) for the store
    `dflash-fast extract` would write with extraction_options(cfg), from model.target's config alone: no store, no
    document, no weight read (plan.plan_job without data: the layer ids checked against the target, its hidden
    size, the dtype, the top-k, `last`)."""
    target = cfg.model.target
    try:
        job = plan_job(target, None, None, extraction_options(cfg), "cpu", rank=0, world_size=1)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot plan the store of model.target={target!r}: {e} (train.py: model.layer_ids, "
                          f"data.online.dtype, data.online.topk)") from None
    layout = job.layout
    return {"layer_ids": job.layer_ids, "hidden_size": layout.hidden_size, "topk": layout.topk,
            "dtype": layout.dtype, "has_last": layout.has_last, "target": {"path": target}}


def open_batches(store, cfg: TrainConfig, rank: int, world_size: int, split: str, with_last: bool, epoch: int = 0,
                 start_step: int = 0):
    """This rank's batch dicts of one epoch of `split` from `start_step` on: a DataLoader over the store, or
    online an OnlineBatches (the target forward one micro-batch ahead; close() it)."""
    d = cfg.data
    args = (store, d, cfg.seed, rank, world_size, epoch, split, start_step, with_last)
    if Source.of(d).runs_target:
        return OnlineBatches(store, row_batches(*args), d.online.prefetch)
    return iter(make_loader(*args))


def data_identity(manifest: Dict, cfg: TrainConfig, world_size: int) -> Dict:
    """What a checkpoint records about its data and a resume must find unchanged: the store (its token count and
    extraction job) and every setting that decides which micro-batch comes next."""
    d = cfg.data
    return {
        "store_tokens": manifest["num_tokens"],
        "store_job": manifest.get("extraction", {}).get("job"),
        "seq_len": d.seq_len,
        "num_anchors": d.num_anchors,
        "batch_rows": d.batch_rows,
        "grad_accum": cfg.schedule.grad_accum,
        "world_size": world_size,
        "seed": cfg.seed,
        "val_fraction": d.val_fraction,
        "split_seed": d.split_seed,
    }


def to_device(batch: Dict[str, torch.Tensor], device, dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """A batch on `device`, its hidden states (COMPUTE_DTYPE_FIELDS) in the compute `dtype`."""
    out = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    for key in COMPUTE_DTYPE_FIELDS:
        if key in out:
            out[key] = out[key].to(dtype)
    return out


class TrainStream:
    """This rank's training micro-batches, epoch after epoch. `position` = (epoch, next micro-batch index).
    Online, `take_target_seconds()` is the target-forward time of the micro-batches handed out since the last call
    (None from a store)."""

    def __init__(
        self, store, cfg: TrainConfig, rank: int, world_size: int, with_last: bool, epoch: int = 0, index: int = 0
    ):
        self.store, self.cfg, self.rank, self.world_size, self.with_last = store, cfg, rank, world_size, with_last
        self.per_epoch = steps_per_epoch(store, cfg.data, cfg.seed, world_size, "train")
        self.epoch, self.index = epoch, index
        self._it = None
        self._target_seconds = None if Source.of(cfg.data).reads_store else 0.0

    def __next__(self) -> Dict[str, torch.Tensor]:
        if self.index >= self.per_epoch:
            self.close()
            self.epoch, self.index = self.epoch + 1, 0
        if self._it is None:
            self._it = open_batches(self.store, self.cfg, self.rank, self.world_size, "train", self.with_last,
                                    self.epoch, self.index)
        self.index += 1
        batch = next(self._it)
        if isinstance(self._it, OnlineBatches):
            self._target_seconds += self._it.take_target_seconds()
        return batch

    def take_target_seconds(self) -> Optional[float]:
        seconds = self._target_seconds
        if seconds is not None:
            self._target_seconds = 0.0
        return seconds

    @property
    def position(self) -> Tuple[int, int]:
        return self.epoch, self.index

    def close(self):
        close_batches(self._it)
        self._it = None


def close_batches(batches) -> None:
    """End what open_batches returned: online, the forward computed ahead is dropped (a DataLoader needs nothing)."""
    if isinstance(batches, OnlineBatches):
        batches.close()


def step_batches(stream: "TrainStream", grad_accum: int, block_size: int, sample_from_anchor: bool,
                 device) -> Tuple[List[Dict[str, torch.Tensor]], List[int], float]:
    """One step's micro-batches from `stream`, each one's valid slot count, and the step's count over every rank
    (>= 1): the denominator that makes the step's gradient that of sum(l * w * mask) / sum(mask) (spec.md §5)."""
    micro = [next(stream) for _ in range(grad_accum)]
    counts = [int(slot_targets(b, block_size, sample_from_anchor).slot_mask.sum()) for b in micro]
    total = torch.tensor(float(sum(counts)), dtype=torch.float64, device=device)
    torch.distributed.all_reduce(total)
    return micro, counts, max(float(total), 1.0)
