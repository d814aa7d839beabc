"""Online hidden states (`data.source: online`): the frozen target runs inside the training job, nothing is written.

    JSONL ──plan_job──▶ documents ──batches.row_batches (pack, schedule, anchors)──▶ the documents of a step
          ──TargetRunner (extraction's forward)──▶ per-token fields as a store holds them ──collate──▶ batch dict

The batch dict is the store path's, key for key: the documents are those `dflash-fast extract` reads from the
same JSONL (read_examples, one rank, in file order), packed, scheduled and anchored by the same functions over
the same lengths, and their per-token fields come from the forward extraction runs (TargetRunner: the tap rule,
the pre-norm `last` hook, the parity check, teacher top-k and lse, the store dtype's rounding). A store extracted
from the same JSONL with the same settings therefore trains the same drafter step for step, up to the float
rounding of a differently padded target forward (none when every document runs alone: batch_tokens = 1).

Cost: the target's forward over every document once per epoch (and over the val documents at each validation),
on every rank for its own rows, with the target's weights resident next to the drafter. A document longer than
`seq_len` is cut into pieces that may land in different steps: each such step runs the whole document again.

Throughput: OnlineBatches runs the forward of micro-batch s + 1 on a side thread (on a GPU, on its own CUDA
stream) while the drafter trains on micro-batch s; the drafter only waits when the forward is the slower one.
"""
import contextlib
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, Optional, Sequence

import numpy as np
import torch

from dflash_fast.data.batches import RowBatches
from dflash_fast.extract.plan import ExtractOptions, job_manifest, plan_batches, plan_job
from dflash_fast.extract.runners import make_runner


class OnlineSource:
    """Stands in for a HiddenStateStore: `lengths`, `manifest`, `layout`, `len()`, `source[i]` (document i
    through the target), and `run(items)`, the documents of a step in padded forwards.

    The target is loaded here (bf16 on CUDA, fp32 on CPU, as extraction picks), on this rank's device, or, with
    an `address`, served by `dflash-fast serve-target` there (serve_target.py: only the forwards move).
    """

    def __init__(self, target: str, jsonl: str, options: ExtractOptions, device=None, address: str = "",
                 served: Optional[Dict] = None):
        # Every record, as a one-rank extraction reads them: training ranks split rows, not records.
        self.job = plan_job(target, jsonl, None, options, device, rank=0, world_size=1)
        # A served target (`dflash-fast serve-target` at `address`) runs the forwards, else this process does.
        self.runner = make_runner(self.job, address, served)
        self.layout = self.job.layout
        self.lengths = np.asarray([len(e.input_ids) for e in self.job.examples], dtype=np.int64)
        if not len(self.lengths):
            raise ValueError(f"{jsonl}: no usable documents ({self.job.stats.to_dict()})")
        self.path = f"online: {target} over {jsonl}"
        manifest = job_manifest(self.job, self.runner)
        # the conversations by the thinking setting they render with, as a store's extraction.thinking counts them
        manifest["extraction"]["thinking"] = dict(sorted(self.job.stats.thinking.items()))
        self.manifest = {
            **manifest,
            "num_sequences": len(self.lengths),
            "num_tokens": int(self.lengths.sum()),
            "num_loss_tokens": int(sum(int(e.loss_mask.sum()) for e in self.job.examples)),
        }
        self._lock = threading.Lock()  # one forward at a time: the runner's norm hook collects one forward's input
        device = self.job.device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, item: int) -> Dict[str, torch.Tensor]:
        return self.run([item])[item]

    def exclusive(self) -> threading.Lock:
        """Held, the target runs no prefetched forward (evaluate/validation.py decodes with the same model)."""
        return self._lock

    def run(self, items: Sequence[int]) -> Dict[int, Dict[str, torch.Tensor]]:
        """Documents `items` through the target, longest first, in forwards of at most `batch_tokens` padded tokens
        (extraction's plan_batches) -> item -> per-token tensors exactly as `store[item]` holds them (host memory)."""
        items = list(items)
        out = {}
        stream = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        with self._lock, stream:
            for batch in plan_batches([int(self.lengths[i]) for i in items], self.job.options.batch_tokens):
                arrays = self.runner([self.job.examples[items[j]] for j in batch])
                for j, a in zip(batch, arrays):
                    out[items[j]] = self.layout.tensors(a)
        return out


class OnlineBatches:
    """The batches of a RowBatches dataset over an OnlineSource, each step's documents run through the target
    one step ahead on a side thread (`prefetch`), or in line. An iterator of batch dicts; `close()` ends it.

    `take_target_seconds()` returns the target-forward seconds of the batches handed out since the last call.
    """

    def __init__(self, source: OnlineSource, dataset: RowBatches, prefetch: bool = True):
        self.source, self.dataset = source, dataset
        self.step = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dflash-target") if prefetch else None
        self._next: Optional[Future] = None
        self._target_seconds = 0.0

    def _make(self, step: int):
        t = time.perf_counter()
        documents = self.source.run(self.dataset.documents(step))
        seconds = time.perf_counter() - t
        batch = self.dataset.collate(step, documents)
        if torch.cuda.is_available():
            batch = {k: v.pin_memory() for k, v in batch.items()}  # the trainer's copy to the GPU is then async
        return batch, seconds

    def __iter__(self):
        return self

    def __next__(self) -> Dict[str, torch.Tensor]:
        if self.step >= len(self.dataset):
            raise StopIteration
        if self._pool is None:
            batch, seconds = self._make(self.step)
        else:
            current = self._next or self._pool.submit(self._make, self.step)
            ahead = self.step + 1
            self._next = self._pool.submit(self._make, ahead) if ahead < len(self.dataset) else None
            batch, seconds = current.result()
        self.step += 1
        self._target_seconds += seconds
        return batch

    def take_target_seconds(self) -> float:
        seconds, self._target_seconds = self._target_seconds, 0.0
        return seconds

    def close(self) -> None:
        """Drop the step computed ahead (it is recomputed, identically, by whoever resumes from here)."""
        if self._pool is not None:
            if self._next is not None:
                self._next.cancel()
            self._pool.shutdown(wait=True)
            self._pool, self._next = None, None
