"""What a training run measures and where it goes (spec.md §6).

    Sums        per step: sums over micro-batches, added over ranks before anything is divided
    Window      the steps since the last record: their Sums, seconds per phase, wall seconds -> throughput
    MetricsLog  OUT/metrics.jsonl, one JSON record a line (and OUT/tensorboard, and W&B / MLflow: trackers.py):
                rank 0 writes it; a resumed run keeps the records up to its step and drops a torn last line (a run
                killed mid-write)

A "train" record (train_record) holds the window's loss, kl, acc_1..acc_{B-1} and tau_offline, tokens_per_s and
anchors_per_s, mean milliseconds per phase and per step, lr, grad_norm and peak_memory_mb; a "val" record
(val_record) the validation's metrics and batch count. On rank 0 a tqdm bar shows each step's loss, tau_offline
and tokens per second (progress_bar, show_step).
"""
import contextlib
import json
import os
import resource
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from dflash_fast.drafter.model import DrafterOutput, slot_metrics


class Sums:
    """Sums that ranks add together before anything is divided (spec.md §6).

    loss_sum = sum(l * w * mask), kl_sum likewise, slots = sum(mask); acc_hits/acc_count/alpha_sum [B];
    tau_sum, blocks; tokens (row positions), anchors (valid); nonfinite, stop: flags (> 0 on any rank);
    nonfinite_pieces: document pieces the loader dropped for a NaN / inf value (data/batches.py);
    DFlash2's selector (spec.md §9): selector_slots (trained slots of a drafter with a selector), recall_hits (those
    whose teacher argmax is in the unary top-K), selector_hits (of these, the ones the selector ranks first).
    """

    NAMES = ("loss_sum", "kl_sum", "slots", "tau_sum", "blocks", "tokens", "anchors", "nonfinite", "stop",
             "selector_slots", "recall_hits", "selector_hits", "nonfinite_pieces")

    def __init__(self, block_size: int, device):
        self.b = block_size
        self.v = torch.zeros(len(self.NAMES) + 3 * block_size, dtype=torch.float64, device=device)

    def __getitem__(self, name: str) -> float:
        return float(self.v[self.NAMES.index(name)])

    def add(self, name: str, value) -> None:
        self.v[self.NAMES.index(name)] += value

    def add_output(self, out: DrafterOutput, batch: Dict[str, torch.Tensor]) -> None:
        """One forward's contribution; loss and kl come back from their mean over max(slots, 1)."""
        n = len(self.NAMES)
        count = out.slot_mask.sum()
        denom = count.clamp(min=1).double()
        self.add("loss_sum", out.loss.detach().double() * denom)
        if out.kl is not None:
            self.add("kl_sum", out.kl.detach().double() * denom)
        self.add("slots", count)
        m = slot_metrics(out)
        self.v[n : n + self.b] += m["acc_hits"].double()
        self.v[n + self.b : n + 2 * self.b] += m["acc_count"].double()
        self.v[n + 2 * self.b :] += m["alpha_sum"].double()
        self.add("tau_sum", m["tau_sum"])
        self.add("blocks", m["blocks"])
        self.add("tokens", batch["input_ids"].numel())
        self.add("anchors", batch["anchor_valid"].sum())
        self.add("nonfinite", (~torch.isfinite(out.loss.detach())).double())
        if "nonfinite_pieces" in batch:
            self.add("nonfinite_pieces", batch["nonfinite_pieces"].sum())
        if out.recall is not None:
            self.add("selector_slots", count)
            self.add("recall_hits", (out.recall & out.slot_mask).sum())
            self.add("selector_hits", (out.selector_hit & out.slot_mask).sum())

    def merge(self, other: "Sums") -> None:
        self.v += other.v

    def all_reduce(self) -> "Sums":
        dist.all_reduce(self.v)
        return self

    def metrics(self, with_kl: bool) -> Dict[str, Optional[float]]:
        """loss, kl (kinds with a soft teacher), acc_1..acc_{B-1} and alpha_1..alpha_{B-1} (mean acceptance
        estimate per slot; None where no slot was valid), tau_offline; with DFlash2's selector recall_at_k (the
        teacher argmax among the unary top-K) and selector_acc (the selector's teacher-forced accuracy where it is:
        speculators' teacher_forced_selector_acc)."""
        n = len(self.NAMES)
        slots = max(self["slots"], 1.0)
        out = {"loss": self["loss_sum"] / slots}
        if with_kl:
            out["kl"] = self["kl_sum"] / slots
        hits, counts, alphas = self.v[n:].view(3, self.b).tolist()
        for j in range(1, self.b):
            out[f"acc_{j}"] = hits[j] / counts[j] if counts[j] else None
        for j in range(1, self.b):
            out[f"alpha_{j}"] = alphas[j] / counts[j] if counts[j] else None
        out["tau_offline"] = self["tau_sum"] / self["blocks"] if self["blocks"] else None
        out["nonfinite_pieces"] = int(self["nonfinite_pieces"])
        if self["selector_slots"]:
            out["recall_at_k"] = self["recall_hits"] / self["selector_slots"]
            out["selector_acc"] = self["selector_hits"] / self["recall_hits"] if self["recall_hits"] else None
        return out


@contextlib.contextmanager
def timed(times: Dict[str, float], phase: str, sync: Callable[[], None] = lambda: None):
    """times[phase] += the seconds the block takes, `sync()` (the device's) included so its queued work counts."""
    start = time.perf_counter()
    yield
    sync()
    times[phase] += time.perf_counter() - start


class Window:
    """What the steps since the last metrics record add up to: their Sums, seconds per phase, wall seconds."""

    def __init__(self, block_size: int, device):
        self.sums, self.phase_seconds, self.steps, self.seconds = Sums(block_size, device), {}, 0, 0.0

    def add(self, sums: Sums, phase_seconds: Dict[str, float], seconds: float) -> None:
        self.sums.merge(sums)
        self.steps += 1
        self.seconds += seconds
        for phase, value in phase_seconds.items():
            self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + value

    def metrics(self, with_kl: bool) -> Dict[str, Optional[float]]:
        """spec.md §6 metrics of the window, throughput, and mean milliseconds per phase and per step."""
        return {
            **self.sums.metrics(with_kl),
            "tokens_per_s": self.sums["tokens"] / self.seconds,
            "anchors_per_s": self.sums["anchors"] / self.seconds,
            **{f"time_{phase}_ms": 1e3 * value / self.steps for phase, value in self.phase_seconds.items()},
            "step_time_ms": 1e3 * self.seconds / self.steps,
        }


def progress_bar(total: int, initial: int, enabled: bool):
    """The tqdm bar of optimizer steps on stdout (rank 0 with logging.progress)."""
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True, file=sys.stdout)


def show_step(bar, sums: Sums, seconds: float, tau: Optional[float] = None) -> None:
    """One step on the bar: its loss, tau_offline, the newest real `tau` (validation.prompts) and tokens per
    second."""
    step_metrics = sums.metrics(False)
    bar.update(1)
    bar.set_postfix(
        {
            "loss": f"{step_metrics['loss']:.3f}",
            "tau_offline": f"{step_metrics['tau_offline'] or 0:.2f}",
            **({} if tau is None else {"tau": f"{tau:.2f}"}),
            "tok/s": f"{sums['tokens'] / seconds:.0f}",
        },
        refresh=False,
    )


def peak_memory_mb() -> float:
    """This process's peak GPU memory allocated (on a GPU), else its peak resident set, in MiB."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def train_record(step: int, epoch: float, window: Window, with_kl: bool, lr: float,
                 grad_norm: Optional[float]) -> Dict:
    """The metrics.jsonl record of the training steps in `window`, ending at `step` (epoch: fractional)."""
    return {
        "split": "train",
        "step": step,
        "epoch": epoch,
        **window.metrics(with_kl),
        "lr": lr,
        "grad_norm": grad_norm,
        "peak_memory_mb": peak_memory_mb(),
    }


def val_record(step: int, sums: Sums, with_kl: bool, batches: int) -> Dict:
    """The metrics.jsonl record of a validation at `step` over `batches` batches (all ranks)."""
    return {"split": "val", "step": step, **sums.metrics(with_kl), "batches": batches}


def records_up_to(path: str, step: int) -> List[str]:
    """The lines of the metrics file at `path` whose record is at most `step` (a resume's past), each ending in a
    newline.

    A run killed mid-write (kill -9, a node lost) leaves a torn last line: it is dropped, saying so in one line on
    stderr. Any other line that is not a JSON record with an integer step is damage a resume cannot repair: a
    ValueError naming the file and the line."""
    with open(path, errors="replace") as f:
        lines = f.readlines()
    kept = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            if not (isinstance(record, dict) and isinstance(record.get("step"), int)):
                raise ValueError("a JSON record with an integer step expected")
        except ValueError as e:  # json.JSONDecodeError is one
            if number == len(lines):
                print(f"{path}: dropped its torn last line {number} (the run stopped while writing it): "
                      f"{line[:60]!r}", file=sys.stderr)
                break
            raise ValueError(f"{path} line {number} is not a metrics record ({e}): repair or delete that line, "
                             f"then resume again") from None
        if record["step"] <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    return kept


class MetricsLog:
    """OUT/metrics.jsonl, with OUT/tensorboard when asked: written by rank 0, a no-op on the other ranks.

    A fresh run (`resumed_step` 0) starts an empty file; a resumed one keeps the records up to its step."""

    def __init__(self, out_dir: str, resumed_step: int, tensorboard: bool, writer: bool, trackers=()):
        """`trackers`: dflash_fast.train.trackers' W&B / MLflow runs, each given every record (rank 0 only)."""
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.writer, self.tensorboard, self.trackers = writer, None, list(trackers)
        if not writer:
            return
        kept = records_up_to(self.path, resumed_step) if resumed_step and os.path.exists(self.path) else []
        with open(self.path, "w") as f:
            f.writelines(kept)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(os.path.join(out_dir, "tensorboard"))

    def record(self, entry: Dict) -> None:
        if not self.writer:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")
        if self.tensorboard is not None:
            for key, value in entry.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tensorboard.add_scalar(f"{entry['split']}/{key}", value, entry["step"])
        for tracker in self.trackers:
            tracker.log(entry)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        for tracker in self.trackers:
            tracker.close()
