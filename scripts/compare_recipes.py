"""Which recipe wins on the embedded target: position weights (decay | D-PACE) x optimizer (AdamW | Muon) x loss.

    python scripts/compare_recipes.py --out out/compare --seeds 0,1,2 --epochs 6 [--num-prompts 300 ...]
    python scripts/compare_recipes.py --out out/losses --arms "D-PACE + Muon" --losses kl,tv,lk,lk_hybrid

Builds the quickstart's store once (regenerate + extract, as `dflash-fast quickstart` does), then for every arm
and seed trains the quickstart drafter with `deepspeed train.py --config configs/tiny.yaml` (same store, steps and
seeds for every arm), measures real `tau` and `tau_offline` with `dflash-fast eval` on the 40 held-out prompts,
and writes OUT/table.md (mean, sample standard deviation and range over the seeds) and OUT/results.json.
`--losses` crosses every arm with those `loss.kind`s (default: tiny.yaml's own, `auto`).
Runs and evals already complete in OUT are reused.
"""
import argparse
import json
import os
import statistics
import subprocess

from dflash_fast.evaluate.quickstart import ASSETS, REPO, TARGET, build_store, train_command

ADAMW = ["optimizer.kind=adamw", "optimizer.grad_clip=1.0"]  # tiny.yaml's AdamW settings before Muon won
MUON = ["optimizer.kind=muon", "optimizer.grad_clip=0"]
ARMS = {
    "decay + AdamW": ["loss.weighting=decay", *ADAMW],
    "decay + Muon": ["loss.weighting=decay", *MUON],
    "D-PACE + AdamW": ["loss.weighting=dpace", *ADAMW],
    "D-PACE + Muon": ["loss.weighting=dpace", *MUON],
}


def run_arm(out, store, arm, loss, seed, epochs, eval_prompts, eval_tokens):
    """Train one arm with one loss kind (None: tiny.yaml's) and one seed and evaluate it -> the eval report."""
    name = arm.replace(" + ", "_").replace("-", "").lower() + (f"_{loss}" if loss else "")
    run_dir = os.path.join(out, name, f"seed{seed}")
    report_path = os.path.join(run_dir, "eval.json")
    if os.path.exists(report_path):
        return read_run(run_dir)
    export = os.path.join(run_dir, "export", "model.safetensors")
    if not os.path.exists(export):
        overrides = [f"data.store={store}", f"output_dir={run_dir}", f"model.target={TARGET}", f"seed={seed}",
                     f"schedule.epochs={epochs}", "validation.every=0", "checkpoint.every=0", "logging.progress=false",
                     *ARMS[arm], *([f"loss.kind={loss}"] if loss else [])]
        cmd = train_command(os.path.join(REPO, "configs", "tiny.yaml"), overrides)
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    cmd = ["dflash-fast", "eval", "--target", TARGET, "--drafter", os.path.dirname(export),
           "--data", os.path.join(ASSETS, "prompts_eval.jsonl"), "--num-prompts", str(eval_prompts),
           "--max-new-tokens", str(eval_tokens),
           "--no-baseline", "--out", report_path]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return read_run(run_dir)


def read_run(run_dir):
    """The eval report, plus `val_kl`, `val_loss` and `val_alpha`: the held-out KL, loss and mean over the slots of
    the acceptance estimate alpha_j of the final validation (runs from before alpha was logged: None)."""
    with open(os.path.join(run_dir, "eval.json")) as f:
        report = json.load(f)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        val = [r for r in map(json.loads, f) if r["split"] == "val"][-1]
    alphas = [v for k, v in val.items() if k.startswith("alpha_") and v is not None]
    val_alpha = statistics.mean(alphas) if alphas else None
    return dict(report, val_kl=val["kl"], val_loss=val["loss"], val_alpha=val_alpha)


def table(results):
    """Markdown: per arm, mean +- sample std (min-max) over seeds of real tau, tau_offline, the held-out KL and
    the held-out mean alpha."""

    def cell(values):
        if None in values:
            return "–"
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{statistics.mean(values):.3f} ± {spread:.3f} ({min(values):.3f}–{max(values):.3f})"

    lines = ["| arm | seeds | real `tau` | `tau_offline` | held-out KL (nats) | held-out mean `alpha_j` |",
             "|---|---|---|---|---|---|"]
    for arm, reports in results.items():
        seeds = ", ".join(str(s) for s in sorted(reports))
        cells = [cell([r[key] for r in reports.values()]) for key in ("tau", "tau_offline", "val_kl", "val_alpha")]
        lines.append(f"| {arm} | {seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="out/compare")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--epochs", type=float, default=6, help="schedule.epochs of every run (tiny.yaml ships 24)")
    p.add_argument("--num-prompts", type=int, default=300, help="training prompts regenerated into the store")
    p.add_argument("--max-new-tokens", type=int, default=128, help="response length when regenerating")
    p.add_argument("--eval-prompts", type=int, default=40, help="held-out prompts for eval (of 40)")
    p.add_argument("--eval-max-new-tokens", type=int, default=96)
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of: {', '.join(ARMS)}")
    p.add_argument("--losses", default="", help="comma-separated loss.kind values to cross with every arm "
                   "(kl, tv, lk, lk_hybrid, rkl, jsd, ...); default: tiny.yaml's")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16", "fp8"],
                   help="the store's dtype (extract --dtype): compare stores with one --out per dtype")
    args = p.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",")]
    losses = [k.strip() for k in args.losses.split(",") if k.strip()] or [None]
    store = build_store(args.out, args.num_prompts, args.max_new_tokens, dtype=args.dtype)
    runs = {f"{arm}, loss {loss}" if loss else arm: (arm, loss) for arm in arms for loss in losses}
    results = {label: {} for label in runs}
    for seed in (int(s) for s in args.seeds.split(",")):  # seed-major: every arm has a result early on
        for label, (arm, loss) in runs.items():
            results[label][seed] = run_arm(args.out, store, arm, loss, seed, args.epochs, args.eval_prompts,
                                           args.eval_max_new_tokens)
            write_outputs(args.out, results)  # a partial table as soon as there is one result
    print(write_outputs(args.out, results))


def write_outputs(out, results):
    """OUT/results.json and OUT/table.md of the runs so far -> the table."""
    results = {label: reports for label, reports in results.items() if reports}
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({arm: {s: {k: r[k] for k in ("tau", "tau_offline", "val_kl", "val_alpha", "acceptance_histogram")}
                         for s, r in reports.items()} for arm, reports in results.items()}, f, indent=1)
    text = table(results)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text + "\n")
    return text


if __name__ == "__main__":
    main()
