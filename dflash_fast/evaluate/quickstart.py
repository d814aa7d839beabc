"""`dflash-fast quickstart`: the whole pipeline on the embedded target, on a CPU, in minutes.

    embedded target ─regenerate─▶ responses ─extract─▶ store ─deepspeed train.py─▶ run/export ─eval─▶ tau
                                           (--online: ───────── deepspeed train.py, the target in the job ─▶ ...)

Every stage is the real one (the same functions and the same `deepspeed train.py` a user runs);
only the sizes are small. Stages resume: re-running skips what is already complete.
--long-context chains the answered prompts into multi-turn conversations of up to LONG_SEQ_LEN tokens, trains on
them at that length and evaluates on held-out conversations that span every context bucket (docs/long-context.md).
"""
import importlib.util
import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Sequence, Tuple

from dflash_fast.errors import UserError
from dflash_fast.evaluate.evaluate import evaluate
from dflash_fast.extract.extract import extract
from dflash_fast.extract.regenerate import regenerate
from dflash_fast.target.prompts import encode_prompt, read_prompts
from dflash_fast.train.checkpoint import checkpoint_tags
from dflash_fast.train.distributed import free_port

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(PACKAGE)
ASSETS = os.path.join(PACKAGE, "assets")
TARGET = os.path.join(ASSETS, "target")
MAX_SEQ_LEN = 512  # tokens per document kept (extract --max-seq-len); tiny.yaml packs rows of 512
# --long-context: documents and rows up to the embedded target's max_position_embeddings (it was trained at 256).
LONG_SEQ_LEN = 2048
# One row of 2048 with 256 anchors: tiny.yaml's tokens and anchors per step (4 rows x 512, 4 x 64 anchors), so at the
# same epochs both lengths train the same number of steps on about the same tokens.
LONG_OVERRIDES = [f"data.seq_len={LONG_SEQ_LEN}", "data.batch_rows=1", "data.num_anchors=256"]
SHORTEST_EVAL_CONTEXT = 128  # --long-context eval prompts: 128 .. LONG_SEQ_LEN - eval_max_new_tokens tokens
# --drafter: the training config of each drafter kind (DSpark: docs/dspark.md, DFlash2: docs/dflash2.md)
DRAFTER_CONFIGS = {"dflash": "tiny.yaml", "dspark": "tiny_dspark.yaml", "dflash2": "tiny_dflash2.yaml"}


def train_command(config: str, overrides: List[str]) -> List[str]:
    """`deepspeed --num_gpus 1 train.py --config CONFIG k=v ...` (one process; CPU or one GPU). The launcher is this
    interpreter's (`python -m deepspeed.launcher.runner`, what the `deepspeed` script runs), so a venv that is not
    on PATH, or another `deepspeed` first on PATH, changes nothing."""
    if importlib.util.find_spec("deepspeed") is None:
        raise UserError(f"deepspeed is not installed for {sys.executable}: pip install deepspeed "
                        f"(it is in install_requires)")
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner"]
    script = os.path.join(REPO, "train.py")
    if not os.path.exists(script):
        raise UserError(f"{script} not found: run the quickstart from a checkout of dflash-fast (pip install -e .)")
    return [*launcher, "--num_gpus", "1", "--master_port", str(free_port()), script, "--config", config, *overrides]


def regenerate_data(out: str, num_prompts: int = 300, max_new_tokens: int = 128, progress: bool = True,
                    stage=lambda _name: None) -> str:
    """Stage 1 into `out`: the target answers the training prompts -> the path of OUT/train.jsonl."""
    stage("1/5 regenerate: the target answers the training prompts")
    regen = os.path.join(out, "train.jsonl")
    regenerate(
        TARGET,
        os.path.join(ASSETS, "prompts_train.jsonl"),
        regen,
        batch_size=16,
        max_new_tokens=max_new_tokens,
        num_prompts=num_prompts,
        progress=progress,
    )
    return regen


def chain_turns(answered: Sequence[Dict], tokenizer, budget: int) -> Tuple[Dict, int]:
    """One multi-turn prompt from the answered prompts in order: their user and assistant turns, then the next
    user turn, as many as keep the encoded prompt (chat template and generation prompt included) within `budget`
    tokens, at least one -> ({"conversations", "sources"}, answered records used)."""
    turns, best, used = [], None, 0
    for r in answered:
        user, assistant = r["conversations"][-2:]
        candidate = turns + [user]
        prompt = read_prompts([{"conversations": candidate}])[0]
        if best is not None and len(encode_prompt(tokenizer, prompt)) > budget:
            break
        best, used = candidate, used + 1
        turns = candidate + [assistant]
    sources = [r.get("source") for r in answered[:used]]
    return {"conversations": best, "sources": sources}, used


def long_context_data(out: str, train_answers: str, eval_prompts: int, max_new_tokens: int,
                      eval_max_new_tokens: int, progress: bool = True) -> Tuple[str, str]:
    """--long-context data from the answers to the short prompts -> (OUT/train_long.jsonl, OUT/eval_long.jsonl).

    train_long: the training prompts chained in order into conversations of up to LONG_SEQ_LEN - max_new_tokens
    tokens, each prompt used once (about the short store's tokens), the last turn answered by the target with the
    whole conversation before it. eval_long: `eval_prompts` conversations of the held-out prompts (answered alone
    first), conversation i starting at prompt i, their lengths spread geometrically from SHORTEST_EVAL_CONTEXT to
    LONG_SEQ_LEN - eval_max_new_tokens tokens so that every context bucket of the eval report gets blocks."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    answered = [json.loads(line) for line in open(train_answers) if line.strip()]
    chained, start = [], 0
    while start < len(answered):
        record, used = chain_turns(answered[start:], tokenizer, LONG_SEQ_LEN - max_new_tokens)
        chained.append(record)
        start += used
    train_long = os.path.join(out, "train_long.jsonl")
    regenerate(TARGET, chained, train_long, batch_size=4, max_new_tokens=max_new_tokens, progress=progress)

    eval_answers = os.path.join(out, "eval_answers.jsonl")
    regenerate(TARGET, os.path.join(ASSETS, "prompts_eval.jsonl"), eval_answers, batch_size=16,
               max_new_tokens=max_new_tokens, progress=progress)
    held_out = [json.loads(line) for line in open(eval_answers) if line.strip()]
    longest = LONG_SEQ_LEN - eval_max_new_tokens
    budgets = [round(SHORTEST_EVAL_CONTEXT * (longest / SHORTEST_EVAL_CONTEXT) ** (i / max(eval_prompts - 1, 1)))
               for i in range(eval_prompts)]
    eval_long = os.path.join(out, "eval_long.jsonl")
    with open(eval_long, "w") as f:
        for i, budget in enumerate(budgets):
            record, _ = chain_turns(held_out[i % len(held_out):] + held_out[: i % len(held_out)], tokenizer, budget)
            f.write(json.dumps(record) + "\n")
    return train_long, eval_long


def extract_store(out: str, regen: str, progress: bool = True, stage=lambda _name: None, dtype: str = "fp32",
                  max_seq_len: int = MAX_SEQ_LEN) -> str:
    """Stage 2 into `out`: extraction of the JSONL `regen` writes OUT/store -> its path.
    dtype: the store's --dtype (fp32, bf16, fp16 or fp8); max_seq_len: tokens per document kept."""
    stage("2/5 extract: tapped hidden states and teacher summaries into the store")
    store = os.path.join(out, "store")
    extract(TARGET, regen, store, dtype=dtype, max_seq_len=max_seq_len, progress=progress)
    return store


def build_store(out: str, num_prompts: int = 300, max_new_tokens: int = 128, progress: bool = True,
                stage=lambda _name: None, dtype: str = "fp32") -> str:
    """Stages 1-2 into `out`: the target answers the training prompts, extraction writes OUT/store -> its path."""
    return extract_store(out, regenerate_data(out, num_prompts, max_new_tokens, progress, stage), progress, stage,
                         dtype)


def quickstart(
    out: str = "out/quickstart",
    num_prompts: int = 300,
    eval_prompts: int = 40,
    max_new_tokens: int = 128,
    eval_max_new_tokens: int = 96,
    epochs: float = 0,
    extra_overrides: List[str] = (),
    progress: bool = True,
    store_dtype: str = "fp32",
    online: bool = False,
    drafter: str = "dflash",
    long_context: bool = False,
) -> Dict:
    """Run every stage into `out`; returns the eval report (also written to OUT/eval.json).
    store_dtype: the store's --dtype (fp32, bf16, fp16 or fp8). online: no store; the trainer runs the target
    over the regenerated JSONL itself (data.source=online), rounding the hidden states as `store_dtype` would.
    drafter: `dflash` (configs/tiny.yaml), `dspark` (configs/tiny_dspark.yaml: DFlash plus DSpark's heads) or
    `dflash2` (configs/tiny_dflash2.yaml: DFlash plus DFlash2's convolutions and selector, exported as speculators'
    `dflash2` type).
    long_context: train on the answered prompts chained into conversations of up to LONG_SEQ_LEN tokens, at that
    row length (LONG_OVERRIDES), and evaluate on OUT/eval_long.jsonl (long_context_data)."""
    config = os.path.join(REPO, "configs", DRAFTER_CONFIGS[drafter])
    os.makedirs(out, exist_ok=True)
    t0 = time.perf_counter()
    stage = lambda name: print(f"\n== {name} ({time.perf_counter() - t0:.0f}s)", flush=True)

    run_dir = os.path.join(out, "run")
    overrides = [f"output_dir={run_dir}", f"model.target={TARGET}"]
    regen = regenerate_data(out, num_prompts, max_new_tokens, progress, stage)
    max_seq_len, eval_data = MAX_SEQ_LEN, os.path.join(ASSETS, "prompts_eval.jsonl")
    if long_context:
        stage(f"1/5 regenerate: conversations of up to {LONG_SEQ_LEN} tokens, the target answers their last turn")
        regen, eval_data = long_context_data(out, regen, eval_prompts, max_new_tokens, eval_max_new_tokens, progress)
        max_seq_len = LONG_SEQ_LEN
        overrides += LONG_OVERRIDES
    if online:
        stage("2/5 extract: skipped (--online: the trainer runs the target over the JSONL itself)")
        overrides += ["data.source=online", f"data.jsonl={regen}", f"data.online.max_seq_len={max_seq_len}",
                      f"data.online.dtype={store_dtype}"]
    else:
        store = extract_store(out, regen, progress, stage, store_dtype, max_seq_len)
        overrides.append(f"data.store={store}")

    stage(f"3/5 train: deepspeed train.py --config configs/{DRAFTER_CONFIGS[drafter]}")
    if epochs:
        overrides.append(f"schedule.epochs={epochs}")
    if checkpoint_tags(os.path.join(run_dir, "checkpoints")):
        overrides.append("--resume")
    cmd = train_command(config, overrides + list(extra_overrides))
    print(" ".join(cmd), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1)))
    code = subprocess.run(cmd, env=env).returncode
    if code:
        raise UserError(f"the training stage failed (exit status {code}); its error is printed above")

    stage("4/5 export: written by the trainer to run/export (speculators format)")
    export_dir = os.path.join(run_dir, "export")
    if not os.path.exists(os.path.join(export_dir, "model.safetensors")):
        raise RuntimeError(f"the trainer wrote no export in {export_dir}")

    stage("5/5 eval: real block speculative decoding on held-out prompts")
    report = evaluate(
        TARGET,
        eval_data,
        export_dir,
        max_new_tokens=eval_max_new_tokens,
        num_prompts=eval_prompts,
        progress=progress,
    )
    with open(os.path.join(out, "eval.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(
        f"\nquickstart done in {time.perf_counter() - t0:.0f}s: tau_offline = "
        f"{report.get('tau_offline', float('nan')):.3f}, "
        f"real tau = {report['tau']:.3f} tokens per target forward (eval report: {out}/eval.json)",
        flush=True,
    )
    return report


def add_arguments(parser) -> None:
    parser.add_argument("--out", default=None,
                        help="working directory (re-running resumes); default out/quickstart, out/quickstart_dspark")
    parser.add_argument("--drafter", choices=sorted(DRAFTER_CONFIGS), default="dflash",
                        help="dflash (configs/tiny.yaml), dspark (configs/tiny_dspark.yaml, docs/dspark.md) or dflash2 "
                             "(configs/tiny_dflash2.yaml, docs/dflash2.md)")
    parser.add_argument("--num-prompts", type=int, default=300, help="training prompts to regenerate")
    parser.add_argument("--eval-prompts", type=int, default=40, help="held-out prompts for eval")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="response length when regenerating")
    parser.add_argument("--eval-max-new-tokens", type=int, default=96)
    parser.add_argument("--epochs", type=float, default=0, help="override configs/tiny.yaml's schedule.epochs")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16", "fp8"], default="fp32",
                        help="the store's dtype of hidden/last (dflash-fast extract --dtype)")
    parser.add_argument("--online", action="store_true",
                        help="no store: the trainer runs the target over the regenerated data (data.source=online)")
    parser.add_argument("--long-context", action="store_true",
                        help=f"train on multi-turn conversations of up to {LONG_SEQ_LEN} tokens at that row length "
                             f"and evaluate on held-out ones of {SHORTEST_EVAL_CONTEXT} to {LONG_SEQ_LEN} minus "
                             "--eval-max-new-tokens tokens (docs/long-context.md)")
    parser.add_argument("overrides", nargs="*", help="extra trainer overrides, key=value")


def run(args) -> int:
    name = "quickstart" + ("" if args.drafter == "dflash" else f"_{args.drafter}") + ("_long" * args.long_context)
    quickstart(
        args.out or f"out/{name}",
        args.num_prompts,
        args.eval_prompts,
        args.max_new_tokens,
        args.eval_max_new_tokens,
        args.epochs,
        args.overrides,
        store_dtype=args.dtype,
        online=args.online,
        drafter=args.drafter,
        long_context=args.long_context,
    )
    return 0
