"""Thinking on in training, off in serving (docs/troubleshooting.md): how much real tau a drafter loses when its
prompts are rendered with the other setting of the chat template's thinking switch.

The embedded target with Qwen3's switch added to its chat template (thinking on: its own ChatML generation prompt;
`enable_thinking=false`: the generation prompt followed by an empty `<think>\\n\\n</think>\\n\\n`, as Qwen3 prefills
it). For each training setting: `regenerate --thinking S` (the target's own greedy answers), extract, `deepspeed
train.py --config configs/tiny.yaml`, the trainer's export; then `dflash-fast eval` of each drafter on the held-out
prompts with `--thinking on` and `--thinking off`.

    python bench/thinking_mismatch.py --out out/thinking --num-prompts 96 --eval-prompts 20 --epochs 12

Prints one JSON line per (trained, served) pair and writes OUT/results.json and OUT/table.md. A rerun resumes:
regenerate and extract resume themselves, a drafter whose export exists is not trained again.
"""
import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

from dflash_fast.evaluate.evaluate import evaluate
from dflash_fast.evaluate.quickstart import ASSETS, MAX_SEQ_LEN, REPO, TARGET, train_command
from dflash_fast.extract.extract import extract
from dflash_fast.extract.regenerate import regenerate

SWITCH = ("{%- if add_generation_prompt and enable_thinking is defined and enable_thinking is false -%}"
          "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}")


def switched_target(out: str) -> str:
    """A copy of the embedded target whose chat template has Qwen3's switch (appended after the generation prompt)."""
    target = os.path.join(out, "target")
    if not os.path.exists(target):
        shutil.copytree(TARGET, target)
        path = os.path.join(target, "chat_template.jinja")
        with open(path) as f:
            template = f.read()
        with open(path, "w") as f:
            f.write(template + SWITCH)
    return target


def train_drafter(args, target: str, setting: str) -> str:
    """regenerate --thinking SETTING, extract, train: the trainer's export of a drafter of that setting's data."""
    out = os.path.join(args.out, f"trained_{setting}")
    export = os.path.join(out, "run", "export")
    if os.path.exists(os.path.join(export, "model.safetensors")):
        return export
    data = os.path.join(out, "train.jsonl")
    regenerate(target, os.path.join(ASSETS, "prompts_train.jsonl"), data, batch_size=16,
               max_new_tokens=args.max_new_tokens, num_prompts=args.num_prompts, progress=False, thinking=setting)
    store = os.path.join(out, "store")
    extract(target, data, store, dtype="fp32", max_seq_len=MAX_SEQ_LEN, progress=False)
    overrides = [f"output_dir={os.path.join(out, 'run')}", f"model.target={target}", f"data.store={store}",
                 f"schedule.epochs={args.epochs}", "validation.every=0", "logging.progress=false"]
    cmd = train_command(os.path.join(REPO, "configs", "tiny.yaml"), overrides)
    print(shlex.join(cmd), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1)))
    if subprocess.run(cmd, env=env).returncode:
        sys.exit(f"training on the thinking-{setting} data failed (its error is above)")
    return export


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out/thinking")
    p.add_argument("--train", default="on,off", help="the thinking settings to train drafters on")
    p.add_argument("--num-prompts", type=int, default=96, help="training prompts regenerated")
    p.add_argument("--max-new-tokens", type=int, default=128, help="answer length when regenerating")
    p.add_argument("--epochs", type=float, default=12)
    p.add_argument("--eval-prompts", type=int, default=20)
    p.add_argument("--eval-max-new-tokens", type=int, default=64)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    target = switched_target(args.out)
    rows, t0 = [], time.time()
    for trained in args.train.split(","):
        export = train_drafter(args, target, trained)
        for served in ("on", "off"):
            report = evaluate(target, os.path.join(ASSETS, "prompts_eval.jsonl"), export,
                              max_new_tokens=args.eval_max_new_tokens, num_prompts=args.eval_prompts,
                              progress=False, thinking=served)
            row = dict(trained=trained, served=served, tau=report["tau"], tau_offline=report.get("tau_offline"),
                       greedy_mismatches=report["greedy_mismatches"], new_tokens=report["new_tokens"])
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = dict(command=shlex.join([sys.executable, *sys.argv]), date=time.strftime("%Y-%m-%d"),
                  load_average=os.getloadavg(), wall_s=round(time.time() - t0, 1), cpus=os.cpu_count(), rows=rows)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    table = ("| trained on thinking | served with thinking | real tau | tau_offline |\n|---|---|---|---|\n"
             + "".join(f"| {r['trained']} | {r['served']} | {r['tau']:.3f} | {r['tau_offline']:.3f} |\n"
                       for r in rows))
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
