"""One way to time, measure memory and write results for every benchmark in bench/.

GPU: `triton.testing.do_bench` (CUDA events, L2 flushed between reps) for kernels,
`time_calls_ms` (CUDA events around each call) for whole training steps, and
`torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`. CPU: a
wall-clock fallback for `--smoke` runs only; CPU times are never a performance claim.

    python bench/harness.py DIR            # one Markdown table over every result JSON in DIR
    python bench/harness.py --strict DIR   # and exit 1 when a report is unfit (gpu_suite.sh --dry-run)
"""
import argparse
import datetime
import glob
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional

import torch


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def time_ms(fn: Callable[[], object], warmup: int = 3, rep: int = 10) -> float:
    """Median milliseconds of one call of fn."""
    if torch.cuda.is_available():
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup * 5, rep=rep * 10, return_mode="median"))
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rep):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def time_calls_ms(fn: Callable[[], object], warmup: int = 1, rep: int = 5) -> List[float]:
    """Milliseconds of each of `rep` calls of fn after `warmup` untimed ones, each call timed on its own.

    For calls of a second or more (a training step): no L2 flush, no calibration
    calls, exactly warmup + rep calls. CUDA events on GPU, wall clock on CPU.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rep):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def peak_memory_mb(fn: Callable[[], object], resident: bool = False) -> Optional[float]:
    """Peak CUDA memory (MB) during one call of fn; None on CPU.

    resident=False: the extra memory beyond what was allocated before the call.
    resident=True: the whole peak, including what stays allocated (weights, optimizer states).
    """
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = 0 if resident else torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment() -> Dict[str, str]:
    import triton

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": _version("transformers"),
        "liger-kernel": _version("liger-kernel"),
        "speculators": _version("speculators"),
        "python": platform.python_version(),
        "commit": commit,
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
    }


def markdown_table(rows: List[Dict[str, object]]) -> str:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else ("" if v is None else str(v))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def write_results(name: str, rows: List[Dict[str, object]], out_dir: str, plot: Optional[Dict[str, str]] = None,
                  meta: Optional[Dict[str, object]] = None) -> str:
    """Write <out_dir>/<name>.json and .md (and .png when plot={'x':..., 'y':..., 'group':...}); returns the Markdown.

    meta: facts about the whole run (shapes, formulas) listed above the table and stored as JSON "meta".
    """
    os.makedirs(out_dir, exist_ok=True)
    env = environment()
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump({"environment": env, "meta": meta or {}, "rows": rows}, f, indent=1)
    facts = {**env, **(meta or {})}
    md = f"## {name}\n\n" + "".join(f"- {k}: `{v}`\n" for k, v in facts.items()) + "\n" + markdown_table(rows) + "\n"
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(md)
    if plot:
        _plot(rows, plot, os.path.join(out_dir, f"{name}.png"), f"{name} on {env['device']}")
    return md


SUMMARY_COLUMNS = (
    "impl",
    "path",
    "kind",
    "loss_kind",
    "layout",
    "N",
    "T",
    "ms",
    "fwd_bwd_ms",
    "step_ms",
    "tokens_per_s",
    "gb_per_s",
    "anchors_per_s",
    "mfu",
    "peak_mb",
    "peak_gb",
    "ratio_vs_bare",
    "speedup_vs_eager",
    "anchors_vs_speculators",
    "peak_vs_speculators",
    "speedup_vs_triton",
    "note",
)


def summary_table(results_dir: str) -> str:
    """One Markdown table over every <name>.json in results_dir: the headline columns of each row."""
    rows = []
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as err:
            rows.append({"bench": os.path.basename(path), "note": f"unreadable: {err}"})
            continue
        for r in data.get("rows", []):
            rows.append({"bench": os.path.basename(path)[:-5], **{c: r[c] for c in SUMMARY_COLUMNS if c in r}})
    return markdown_table(rows) if rows else f"no results in {results_dir}"


def report_problems(results_dir: str) -> List[str]:
    """Why the reports in results_dir are unfit for a dry run: none at all, a JSON unreadable or without rows,
    a row whose note says it failed (a bench records a peer's failure as a result and exits 0; on the CPU
    that failure is our glue code's). [] when every report is fit."""
    paths = sorted(glob.glob(os.path.join(results_dir, "*.json")))
    if not paths:
        return [f"no result JSON in {results_dir}"]
    problems = []
    for path in paths:
        name = os.path.basename(path)
        try:
            with open(path) as f:
                rows = json.load(f).get("rows")
        except (OSError, ValueError, AttributeError) as err:
            problems.append(f"{name}: unreadable: {err}")
            continue
        if not rows:
            problems.append(f"{name}: no rows")
        for r in rows or []:
            if str(r.get("note") or "").startswith("failed"):
                label = r.get("impl", r.get("path", r.get("kind", "?")))
                problems.append(f"{name}: row {label!r} {r['note'].splitlines()[0]}")
    return problems


def _plot(rows, spec, path, title):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    groups = dict.fromkeys(r.get(spec["group"]) for r in rows)
    labels = list(dict.fromkeys(str(r.get(spec["x"])) for r in rows))
    width = 0.8 / max(len(groups), 1)
    for gi, g in enumerate(groups):
        vals = [
            next(
                (
                    r[spec["y"]]
                    for r in rows
                    if r.get(spec["group"]) == g and str(r.get(spec["x"])) == lab and r.get(spec["y"]) is not None
                ),
                0,
            )
            for lab in labels
        ]
        ax.bar([i + gi * width for i in range(len(labels))], vals, width, label=str(g))
    ax.set_xticks([i + width * (len(groups) - 1) / 2 for i in range(len(labels))], labels)
    ax.set_ylabel(spec["y"])
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description="one Markdown table over every result JSON in a folder")
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument("results_dir", nargs="?", default=os.path.join(here, "results"))
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 when there is no report, one is unreadable or empty, or a row failed")
    args = parser.parse_args(argv)
    print(summary_table(args.results_dir))
    problems = report_problems(args.results_dir) if args.strict else []
    for problem in problems:
        print(f"error: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
