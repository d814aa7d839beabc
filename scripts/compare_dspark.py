"""DSpark vs DFlash on the embedded target (docs/dspark.md): one store, then `dflash-fast quickstart` per drafter
kind and seed on it (configs/tiny.yaml and configs/tiny_dspark.yaml: the same recipe, DSpark adds its heads).

    python scripts/compare_dspark.py --out out/dspark_cmp --seeds 0,1,2 --steps 696    # the quickstart budget
    python scripts/compare_dspark.py --out out/dspark_cmp --seeds 0 --steps 60 --num-prompts 64 --eval-prompts 10
    python scripts/compare_dspark.py --out out/dspark_tv --seeds 0,1,2 --steps 48 loss.kind=tv   # overrides: both arms

Prints one JSON line per run (tau, tau_offline, greedy mismatches) and writes OUT/summary.json.
"""
import argparse
import json
import os

from dflash_fast.evaluate.quickstart import build_store, quickstart


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out/dspark_cmp")
    p.add_argument("--seeds", default="0")
    p.add_argument("--steps", type=int, default=0, help="optimizer steps (0 = the configs' 24 epochs)")
    p.add_argument("--drafters", default="dflash,dspark")
    p.add_argument("--num-prompts", type=int, default=300, help="training prompts the target answers (shared)")
    p.add_argument("--eval-prompts", type=int, default=40)
    p.add_argument("--eval-max-new-tokens", type=int, default=96)
    p.add_argument("overrides", nargs="*", help="trainer overrides (key=value) for every run of both drafters")
    args = p.parse_args(argv)
    base = os.path.join(args.out, "base")
    build_store(base, num_prompts=args.num_prompts, progress=False)
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for drafter in args.drafters.split(","):
            out = os.path.join(args.out, f"{drafter}_s{seed}")
            os.makedirs(out, exist_ok=True)
            for name in ("train.jsonl", "store"):  # the shared stages: quickstart resumes past them
                if not os.path.exists(os.path.join(out, name)):
                    os.symlink(os.path.abspath(os.path.join(base, name)), os.path.join(out, name))
            overrides = [f"seed={seed}"] + ([f"schedule.steps={args.steps}"] if args.steps else []) + args.overrides
            report = quickstart(out, num_prompts=args.num_prompts, eval_prompts=args.eval_prompts,
                                eval_max_new_tokens=args.eval_max_new_tokens,
                                extra_overrides=overrides, progress=False, drafter=drafter)
            row = dict(drafter=drafter, seed=seed, steps=args.steps or "24 epochs", tau=report["tau"],
                       tau_offline=report["tau_offline"], greedy_mismatches=report["greedy_mismatches"],
                       block_size=report["block_size"], calibration=report.get("confidence_calibration"))
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(os.path.join(args.out, "summary.json"), "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
