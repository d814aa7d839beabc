"""`dflash-fast plot RUN_DIR`: training curves of a run, from RUN_DIR/metrics.jsonl, to PNG.

    loss.png         loss per split (train, val, ...)
    tau_offline.png  tau_offline per split
    acc.png          per-slot accuracy acc_j, j = 1..B-1, one panel per split

A metrics line is a JSON object. The x axis is `step` (the line number when absent).
The split is `split` ("train" when absent), or a key prefix: `val/loss`, `val_loss`.
Per-slot accuracy is `acc_1`, `acc_2`, ... or a list `acc` holding slots 1, 2, ...
Lines or keys that are none of these are ignored; a figure with no data is not written.
matplotlib is optional: `pip install 'dflash-fast[plot]'`.
"""
import json
import os
import re
from collections import defaultdict
from typing import Dict, List, Tuple

from dflash_fast.errors import UserError

SPLIT_PREFIX = re.compile(r"^(train|val|eval|test)[/_](.+)$")
ACC_KEY = re.compile(r"^acc_(\d+)$")

Series = Dict[str, Dict[str, List[Tuple[float, float]]]]  # split -> curve name -> [(step, value)]


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def read_metrics(path: str) -> Series:
    """metrics.jsonl -> {split: {"loss" | "tau_offline" | "acc_<j>": [(step, value), ...]}}."""
    series: Series = defaultdict(lambda: defaultdict(list))
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a crash mid-write, or a non-metric line
            if not isinstance(record, dict):
                continue
            step = record.get("step", line_no)
            if not _number(step):
                continue
            for key, value in record.items():
                split, name = record.get("split", "train"), key
                m = SPLIT_PREFIX.match(key)
                if m:
                    split, name = m.groups()
                if name == "acc" and isinstance(value, list):
                    for j, v in enumerate(value, 1):
                        if _number(v):
                            series[split][f"acc_{j}"].append((step, float(v)))
                elif _number(value) and (name in ("loss", "tau_offline") or ACC_KEY.match(name)):
                    series[split][name].append((step, float(value)))
    return series


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise UserError("dflash-fast plot needs matplotlib: pip install 'dflash-fast[plot]' "
                           "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(run_dir: str, out_dir: str = None) -> List[str]:
    """Draw RUN_DIR/metrics.jsonl into OUT_DIR (default RUN_DIR) -> paths of the PNGs written."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist: RUN_DIR must be a training run's output directory")
    series = read_metrics(path)
    plt = _pyplot()
    out_dir = out_dir or run_dir
    os.makedirs(out_dir, exist_ok=True)
    written = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, name), dpi=110)
        plt.close(fig)
        written.append(os.path.join(out_dir, name))

    for name, ylabel in (("loss", "loss"), ("tau_offline", "tau_offline (tokens per block)")):
        splits = [s for s in sorted(series) if series[s].get(name)]
        if splits:
            fig, ax = plt.subplots(figsize=(6, 4))
            for s in splits:
                xs, ys = zip(*series[s][name])
                ax.plot(xs, ys, marker="o" if s != "train" else None, label=s)
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend()
            save(fig, f"{name}.png")

    acc_splits = [s for s in sorted(series) if any(ACC_KEY.match(k) for k in series[s])]
    if acc_splits:
        fig, axes = plt.subplots(1, len(acc_splits), figsize=(6 * len(acc_splits), 4), squeeze=False)
        for ax, s in zip(axes[0], acc_splits):
            slots = sorted((int(ACC_KEY.match(k).group(1)), k) for k in series[s] if ACC_KEY.match(k))
            cmap = plt.get_cmap("viridis", max(len(slots), 2))
            for i, (j, k) in enumerate(slots):
                xs, ys = zip(*series[s][k])
                ax.plot(xs, ys, color=cmap(i), label=f"slot {j}")
            ax.set_title(f"per-slot accuracy ({s})")
            ax.set_xlabel("step")
            ax.set_ylabel("acc_j")
            ax.set_ylim(0, 1)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
        save(fig, "acc.png")
    if not written:
        raise ValueError(f"{path} has no loss, tau_offline or acc_j values to plot")
    return written


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a training run's directory (holds metrics.jsonl)")
    parser.add_argument("--out", default=None, help="directory for the PNGs (default: RUN_DIR)")


def run(args) -> int:
    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0
