"""DFlash vs DSpark vs DFlash2 on the embedded target (docs/dflash2.md): one store, then `dflash-fast quickstart` per
drafter kind and seed on it (configs/tiny.yaml, tiny_dspark.yaml, tiny_dflash2.yaml: the same recipe, loss and
budget; DSpark adds its heads, DFlash2 its convolutions and selector), each measured by real block speculative
decoding with our evaluator.

    python bench/compare_drafters.py --out out/drafters --seeds 0,1,2 --steps 24 --num-prompts 32 \\
        --eval-prompts 10 --eval-max-new-tokens 48                        # a small budget
    python bench/compare_drafters.py --out out/drafters_full --seeds 0,1,2   # the quickstart budget (24 epochs)
    python bench/compare_drafters.py --out out/drafters_tv --steps 48 loss.kind=tv   # overrides: every run
    python bench/compare_drafters.py --out out/dspark_cmp --drafters dflash,dspark   # DSpark vs DFlash (docs/dspark.md)

Prints one JSON line per run and writes OUT/results.json (every run with DSpark's confidence calibration where it
has one, the command, the budget, the load average) and OUT/table.md (per drafter: mean ± sample standard deviation
(min-max) over the seeds of real tau and tau_offline). A rerun resumes: finished runs (OUT/<drafter>_s<seed>/row.json)
are read back, not trained again; an unfinished one resumes inside quickstart. Seeds may run as separate processes
on one OUT (`--seeds 1` and `--seeds 2` at once): each writes only its own runs into results.json, so a last pass
with every seed, which trains nothing, writes the whole report.
"""
import argparse
import json
import os
import shlex
import statistics
import sys
import time
from typing import Dict, List

from dflash_fast.evaluate.quickstart import build_store, quickstart

DRAFTERS = ("dflash", "dspark", "dflash2")


def run_one(args, base: str, drafter: str, seed: int) -> Dict:
    """One quickstart of `drafter` at `seed` on the shared store (OUT/<drafter>_s<seed>) -> its row."""
    out = os.path.join(args.out, f"{drafter}_s{seed}")
    os.makedirs(out, exist_ok=True)
    for name in ("train.jsonl", "store"):  # the shared stages: quickstart resumes past them
        if not os.path.exists(os.path.join(out, name)):
            os.symlink(os.path.abspath(os.path.join(base, name)), os.path.join(out, name))
    if os.path.exists(os.path.join(out, "row.json")):  # a finished run: its row, as it was printed
        with open(os.path.join(out, "row.json")) as f:
            return json.load(f)
    t0 = time.time()
    overrides = [f"seed={seed}"] + ([f"schedule.steps={args.steps}"] if args.steps else []) + args.overrides
    report = quickstart(out, num_prompts=args.num_prompts, eval_prompts=args.eval_prompts,
                        eval_max_new_tokens=args.eval_max_new_tokens, extra_overrides=overrides, progress=False,
                        drafter=drafter)
    row = dict(drafter=drafter, seed=seed, tau=report["tau"], tau_offline=report.get("tau_offline"),
               greedy_mismatches=report["greedy_mismatches"], block_size=report["block_size"],
               calibration=report.get("confidence_calibration"), wall_s=round(time.time() - t0, 1))
    with open(os.path.join(out, "row.json"), "w") as f:
        json.dump(row, f)
    return row


def spread(values: List[float]) -> str:
    """mean ± sample standard deviation (min–max)."""
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {sd:.3f} ({min(values):.3f}–{max(values):.3f})"


def table(rows: List[Dict]) -> str:
    """Markdown: one line per drafter over its seeds, then the runs."""
    lines = ["| drafter | seeds | real `tau` | `tau_offline` | greedy mismatches | verify block |",
             "|---|---|---|---|---|---|"]
    for drafter in dict.fromkeys(r["drafter"] for r in rows):
        mine = [r for r in rows if r["drafter"] == drafter]
        lines.append(f"| {drafter} | {', '.join(str(r['seed']) for r in mine)} | {spread([r['tau'] for r in mine])} | "
                     f"{spread([r['tau_offline'] for r in mine])} | "
                     f"{', '.join(str(r['greedy_mismatches']) for r in mine)} | {mine[0]['block_size']} |")
    lines += ["", "| drafter | seed | real `tau` | `tau_offline` |", "|---|---|---|---|"]
    lines += [f"| {r['drafter']} | {r['seed']} | {r['tau']:.3f} | {r['tau_offline']:.3f} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out/drafters")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=0, help="optimizer steps (0 = the configs' 24 epochs)")
    p.add_argument("--drafters", default=",".join(DRAFTERS))
    p.add_argument("--num-prompts", type=int, default=300, help="training prompts the target answers (shared)")
    p.add_argument("--eval-prompts", type=int, default=40)
    p.add_argument("--eval-max-new-tokens", type=int, default=96)
    p.add_argument("overrides", nargs="*", help="trainer overrides (key=value) for every run of every drafter")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    unknown = set(args.drafters.split(",")) - set(DRAFTERS)
    if unknown:
        p.error(f"--drafters: unknown {sorted(unknown)}; choose from {list(DRAFTERS)}")
    base = os.path.join(args.out, "base")
    build_store(base, num_prompts=args.num_prompts, progress=False)
    started = dict(utc=time.strftime("%Y-%m-%d %H:%M", time.gmtime()), load_average=os.getloadavg())
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for drafter in args.drafters.split(","):
            rows.append(run_one(args, base, drafter, seed))
            print(json.dumps(rows[-1]), flush=True)
            results = dict(command=" ".join(["python bench/compare_drafters.py", *map(shlex.quote, argv)]),
                           started=started, now=dict(utc=time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                                                     load_average=os.getloadavg()),
                           budget=dict(steps=args.steps or "24 epochs", num_prompts=args.num_prompts,
                                       eval_prompts=args.eval_prompts, eval_max_new_tokens=args.eval_max_new_tokens,
                                       overrides=args.overrides), runs=rows)
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump(results, f, indent=1)
            with open(os.path.join(args.out, "table.md"), "w") as f:
                f.write(table(rows))


if __name__ == "__main__":
    main()
