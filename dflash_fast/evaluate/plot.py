"""`dflash-fast plot RUN_DIR`: training curves of a run, from RUN_DIR/metrics.jsonl, to PNG.

    loss.png         loss per split (train, val, ...)
    tau_offline.png  tau_offline per split
    acc.png          per-slot accuracy acc_j, j = 1..B-1, one panel per split

A metrics line is a JSON object. The x axis is `step` (the line number when absent).
The split is `split` ("train" when absent), or a key prefix: `val/loss`, `val_loss`.
Per-slot accuracy is `acc_1`, `acc_2`, ... or a list `acc` holding slots 1, 2, ...
Lines or keys that are none of these are ignored; a figure with no data is not written.

`dflash-fast plot --recipes RESULTS.json [--out DIR]`: recipes.png, real `tau` per arm with the spread over seeds
(mean, min-max, every seed where known), one panel per experiment. RESULTS.json is either the `results.json` of
scripts/compare_recipes.py ({arm: {seed: {"tau": ...}}}) or a file of panels
({"panels": [{"title": ..., "arms": {arm: {"tau": [per-seed values] | {"mean", "std", "min", "max"}}}}]}),
such as docs/recipes.json, which holds the measured numbers of docs/recipes.md.
`dflash-fast plot --benchmarks REPORT.json [REPORT2.json ...] [--out DIR]`: benchmarks.png, real `tau` per benchmark
as bars, the published tables' layout (benchmarks along x), from the reports of `dflash-fast eval --benchmark`: each
report's `tau` (pooled) and `tau_zlab` (z-lab's per-prompt mean) side by side.
matplotlib is optional: `pip install 'dflash-fast[plot]'`.
"""
import json
import os
import re
import statistics
import textwrap
from collections import defaultdict
from typing import Dict, List, Tuple

from dflash_fast.errors import ConfigError, UserError, read_mapping

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
            except (json.JSONDecodeError, RecursionError):
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


def _tau_summary(tau, where: str) -> Dict[str, object]:
    """An arm's real tau, as per-seed values or as a summary -> {mean, min, max, seeds (the values or None)}."""
    if isinstance(tau, list) and tau and all(_number(v) for v in tau):
        return {"mean": statistics.mean(tau), "min": min(tau), "max": max(tau), "seeds": [float(v) for v in tau]}
    if isinstance(tau, dict) and all(_number(tau.get(k)) for k in ("mean", "min", "max")):
        return {"mean": tau["mean"], "min": tau["min"], "max": tau["max"], "seeds": None}
    raise ValueError(f"{where}: tau must be a list of per-seed values or {{\"mean\", \"min\", \"max\"}}, got {tau!r}")


def read_recipes(path: str) -> List[Tuple[str, List[Tuple[str, Dict[str, object]]]]]:
    """RESULTS.json (module docstring) -> [(panel title, [(arm, tau summary), ...]), ...]."""
    data = read_mapping(path, json.load, json.JSONDecodeError, ValueError, "JSON", "a mapping of arms or panels")
    if "panels" not in data:  # scripts/compare_recipes.py's results.json: {arm: {seed: {"tau": ...}}}
        arms = {arm: {"tau": [r.get("tau") if isinstance(r, dict) else r for r in seeds.values()]
                      if isinstance(seeds, dict) else seeds} for arm, seeds in data.items()}
        data = {"panels": [{"title": os.path.basename(os.path.dirname(os.path.abspath(path))), "arms": arms}]}
    panels = []
    for i, panel in enumerate(data["panels"] if isinstance(data["panels"], list) else [None]):
        if not isinstance(panel, dict) or not isinstance(panel.get("arms"), dict) or not panel["arms"]:
            raise ValueError(f"{path}: panels[{i}] must be an object with a non-empty \"arms\" object")
        arms = [(arm, _tau_summary(value.get("tau") if isinstance(value, dict) else value, f"{path}: {arm!r}"))
                for arm, value in panel["arms"].items()]
        panels.append((str(panel.get("title", "")), arms))
    return panels


def plot_recipes(path: str, out_dir: str = None) -> List[str]:
    """Draw RESULTS.json's arms into OUT_DIR/recipes.png (default: beside RESULTS.json) -> [its path]."""
    panels = read_recipes(path)
    plt = _pyplot()
    out_dir = out_dir or os.path.dirname(os.path.abspath(path))
    os.makedirs(out_dir, exist_ok=True)
    rows = max(len(arms) for _, arms in panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 0.5 * rows + 1.8), squeeze=False)
    for ax, (title, arms) in zip(axes[0], panels):
        for y, (arm, tau) in enumerate(reversed(arms)):
            ax.plot([tau["min"], tau["max"]], [y, y], color="tab:blue", linewidth=3, alpha=0.35,
                    solid_capstyle="round")
            ax.plot(tau["mean"], y, "o", color="tab:blue", markersize=7)
            for v in tau["seeds"] or []:
                ax.plot(v, y, "|", color="black", markersize=10)
            ax.annotate(f"{tau['mean']:.3f}", (tau["max"], y), xytext=(6, 0), textcoords="offset points",
                        va="center", fontsize=8)
        ax.set_yticks(range(len(arms)), [arm for arm, _ in reversed(arms)])
        ax.set_ylim(-0.6, len(arms) - 0.4)
        lo, hi = min(t["min"] for _, t in arms), max(t["max"] for _, t in arms)
        ax.set_xlim(min(1.0, lo) - 0.05 * (hi - 1.0 + 1e-3), hi + 0.25 * (hi - 1.0 + 1e-3))
        ax.axvline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_xlabel("real tau (tokens per target forward; 1 = no gain)", fontsize=8)
        ax.set_title(textwrap.fill(title, 50), fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    target = os.path.join(out_dir, "recipes.png")
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return [target]


def read_benchmarks(paths: List[str]) -> Tuple[List[str], List[Tuple[str, Dict[str, float]]]]:
    """`eval --benchmark` reports -> (benchmarks in first-seen order, [(series label, {benchmark: tau})]): two series
    per report, `tau` and `tau_zlab`, labelled by the file's name when there are several; four for an `--engine both`
    report (ours and vLLM's)."""
    names: List[str] = []
    series = []
    for path in paths:
        data = read_mapping(path, json.load, json.JSONDecodeError, ValueError, "JSON", "an eval --benchmark report")
        label = "" if len(paths) == 1 else os.path.splitext(os.path.basename(path))[0] + " "
        # `--engine both`: the engines' reports side by side, ours then vLLM's
        parts = [(label, data)] if "benchmarks" in data else [
            (label + engine, data.get(key)) for key, engine in (("hf", "ours "), ("vllm", "vLLM "))]
        for prefix, part in parts:
            rows = part.get("benchmarks") if isinstance(part, dict) else None
            if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) and "benchmark" in r
                                                                 for r in rows):
                raise ValueError(f"{path}: no \"benchmarks\" rows; pass the JSON that `dflash-fast eval --benchmark "
                                 "... --out REPORT.json` wrote")
            for key, what in (("tau", "tau (pooled)"), ("tau_zlab", "tau_zlab (per-prompt mean)")):
                values = {str(r["benchmark"]): float(r[key]) for r in rows if _number(r.get(key))}
                if values:
                    series.append((prefix + what, values))
            names += [str(r["benchmark"]) for r in rows if str(r["benchmark"]) not in names]
    if not series:
        raise ValueError(f"{', '.join(paths)}: no benchmark has a tau (no verification block was run)")
    return names, series


def plot_benchmarks(paths: List[str], out_dir: str = None) -> List[str]:
    """Draw the reports' tau per benchmark into OUT_DIR/benchmarks.png (default: beside the first) -> [its path]."""
    names, series = read_benchmarks(paths)
    plt = _pyplot()
    out_dir = out_dir or os.path.dirname(os.path.abspath(paths[0]))
    os.makedirs(out_dir, exist_ok=True)
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(names) * max(1, len(series) / 2) + 1.5), 4))
    for k, (label, values) in enumerate(series):
        xs = [i + (k - (len(series) - 1) / 2) * width for i, n in enumerate(names) if n in values]
        ys = [values[n] for n in names if n in values]
        bars = ax.bar(xs, ys, width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    tilt = len(names) > 5
    ax.set_xticks(range(len(names)), names, rotation=30 if tilt else 0, ha="right" if tilt else "center")
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_ylabel("tau (tokens per target forward)")
    ax.set_ylim(0, 1.3 * max(max(v.values()) for _, v in series))  # room for the legend above the bars
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", ncol=min(len(series), 4))
    fig.tight_layout()
    target = os.path.join(out_dir, "benchmarks.png")
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return [target]


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", nargs="?",
                        help="a training run's directory (holds metrics.jsonl)")
    parser.add_argument("--recipes", metavar="RESULTS.json", default=None,
                        help="draw real tau per arm and seed from a recipe comparison instead (recipes.png)")
    parser.add_argument("--benchmarks", metavar="REPORT.json", nargs="+", default=None,
                        help="draw tau per benchmark from `eval --benchmark` reports instead (benchmarks.png)")
    parser.add_argument("--out", default=None,
                        help="directory for the PNGs (default: RUN_DIR, or beside RESULTS.json / REPORT.json)")


def run(args) -> int:
    if sum(x is not None for x in (args.run_dir, args.recipes, args.benchmarks)) != 1:
        raise ConfigError("dflash-fast plot takes RUN_DIR or --recipes RESULTS.json or --benchmarks REPORT.json: "
                          "exactly one of them")
    if args.benchmarks is not None:
        written = plot_benchmarks(args.benchmarks, args.out)
    else:
        written = plot_run(args.run_dir, args.out) if args.recipes is None else plot_recipes(args.recipes, args.out)
    for path in written:
        print(path)
    return 0
