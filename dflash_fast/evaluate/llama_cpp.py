"""llama.cpp in the loop (docs/llama-cpp.md): its own tools decode our prompts greedily with and without a GGUF
drafter, and the result is set beside our evaluator's.

    target alone   llama-simple: greedy (llama_sampler_init_greedy), stops at an end-of-generation token; decode
                   tokens/s from its llama_perf_context_print "eval time" (the prompt's prefill left out)
    with drafter   llama-speculative-simple --spec-type draft-dflash, --temp 0: the target's greedy sampler verifies;
                   per verification step "accepted N/M draft tokens" (LOG_DBG, shown with -v); its "decoded ...
                   speed" line leaves the prefill out

Alignment (examples/speculative-simple): llama.cpp's first block is anchored at the prompt's last token (the target
samples the first new token while verifying it), ours at the first new token, which the target's prefill gives
(spec.md §10). Each engine's blocks cover the same output shifted by one token, so their tau may differ by a block's
worth at each prompt's start and end; the greedy outputs must be the same tokens.
"""
import os
import re
import subprocess
from typing import Dict, List, Optional, Sequence

from dflash_fast.evaluate.report import mean_acceptance
from dflash_fast.serve.llama_cpp import draft_settings, read_gguf_fields

ACCEPTED = re.compile(r"accepted (\d+)/(\d+) draft tokens")
DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s")
EVAL_TIME = re.compile(r"\beval time =\s+([\d.]+) ms /\s+(\d+) runs")


# common/log.cpp (common_log_main): the log is written by a worker thread and "logs [may] be lost if not flushed before
# the program exits" (llama.cpp issue #22142); under load the last lines, the speed line among them, go missing. The
# log is FIFO, so a run that printed its "decoded" line printed everything before it: such runs are retried.
LOG_ATTEMPTS = 6


class LlamaCppError(RuntimeError):
    """A llama.cpp tool failed or printed other than this module parses; the message holds its command and output."""


def _run(argv: Sequence[str], timeout: float) -> subprocess.CompletedProcess:
    done = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.decode(errors="replace").strip().splitlines()[-20:])
        raise LlamaCppError(f"{' '.join(argv[:1])} exited {done.returncode}: {' '.join(argv)}\n{tail}")
    return done


def _generated(stdout: bytes, prompt: str) -> str:
    """The text a tool printed after echoing `prompt` (tools print the prompt's pieces first)."""
    text = stdout.decode("utf-8", errors="replace").lstrip("\n")
    if not text.startswith(prompt):
        raise LlamaCppError(f"the tool did not echo the prompt first (it re-tokenized it differently?): "
                            f"{text[:200]!r}")
    return text[len(prompt):].rstrip("\n")  # the tools end with one or two newlines of their own


def target_alone(bin_dir: str, target_gguf: str, prompt: str, max_new_tokens: int, timeout: float = 600) -> Dict:
    """llama-simple: {"text", "tokens", "tokens_per_s"} of the target's own greedy decode."""
    done = _run([os.path.join(bin_dir, "llama-simple"), "-m", target_gguf, "-n", str(max_new_tokens), prompt], timeout)
    err = done.stderr.decode(errors="replace")
    timing = EVAL_TIME.findall(err)
    if not timing:
        raise LlamaCppError(f"llama-simple printed no 'eval time' line:\n{err[-2000:]}")
    ms, runs = float(timing[-1][0]), int(timing[-1][1])
    return {"text": _generated(done.stdout, prompt), "tokens": runs, "tokens_per_s": runs / ms * 1e3 if ms else None}


def with_drafter(bin_dir: str, target_gguf: str, draft_gguf: str, prompt: str, max_new_tokens: int, n_max: int,
                 threads: int = 2, verbose: bool = True, timeout: float = 600, spec_type: str = "draft-dflash") -> Dict:
    """llama-speculative-simple with the DFlash drafter: {"text", "accepted" (per verification step), "drafted",
    "tau", "tokens", "tokens_per_s"}. Without `verbose` (the debug log that holds each step's acceptance): the text
    and tokens/s only."""
    argv = [os.path.join(bin_dir, "llama-speculative-simple"), "-m", target_gguf, "-md", draft_gguf,
            "--spec-type", spec_type, "--spec-draft-n-max", str(n_max), "-p", prompt, "-n", str(max_new_tokens),
            "--temp", "0", "--top-k", "1", "-t", str(threads), "-td", str(threads), "-c", "4096"]
    for _ in range(LOG_ATTEMPTS):
        done = _run(argv + ["-v"] * verbose, timeout)
        err = done.stderr.decode(errors="replace")
        decoded = DECODED.findall(err)
        if decoded:
            break
    else:
        raise LlamaCppError(f"llama-speculative-simple lost its last log lines {LOG_ATTEMPTS} times (no 'decoded' "
                            f"line): {' '.join(argv)}\n{err[-2000:]}")
    steps = [(int(a), int(d)) for a, d in ACCEPTED.findall(err)]
    if verbose and sum(a + 1 for a, _ in steps) != int(decoded[-1][0]):
        raise LlamaCppError(f"llama-speculative-simple's steps accept {sum(a + 1 for a, _ in steps)} tokens, its "
                            f"'decoded' line says {decoded[-1][0]}: {' '.join(argv)}")
    accepted = [a for a, _ in steps]
    histogram = [0] * (max(accepted, default=0) + 1)
    for a in accepted:
        histogram[a] += 1
    return {"text": _generated(done.stdout, prompt), "accepted": accepted, "drafted": [d for _, d in steps],
            "tau": mean_acceptance(histogram), "tokens": int(decoded[-1][0]), "tokens_per_s": float(decoded[-1][2])}


def evaluate_llama_cpp(bin_dir: str, target_gguf: str, draft_gguf: str, prompts: Sequence[str], max_new_tokens: int,
                       threads: int = 2, spec_type: Optional[str] = None,
                       n_max: Optional[int] = None) -> Dict:
    """Each rendered prompt decoded by llama.cpp alone and with the drafter (`spec_type` and the draft count `n_max`
    unless given: the drafter GGUF's own, serve.llama_cpp.draft_settings; with the
    debug log that holds each step's acceptance: its tokens/s include formatting that log, a run without it loses
    its speed line too often to time it, LOG_ATTEMPTS): per prompt the texts and whether they are the same, and over
    all prompts tau (mean n + 1 over every verification step), tau_after_first_step (the same without each prompt's
    first step, the block anchored at the prompt's last token that ours does not draft: the module's docstring)
    and decode tokens/s of each."""
    if spec_type is None or n_max is None:
        gguf_type, gguf_n_max = draft_settings(read_gguf_fields(draft_gguf))
        spec_type = spec_type or gguf_type
        n_max = gguf_n_max if n_max is None else n_max
    rows: List[Dict] = []
    for i, prompt in enumerate(prompts):
        alone = target_alone(bin_dir, target_gguf, prompt, max_new_tokens)
        spec = with_drafter(bin_dir, target_gguf, draft_gguf, prompt, max_new_tokens, n_max, threads,
                            spec_type=spec_type)
        rows.append({"prompt": i, "text_target": alone["text"], "text_speculative": spec["text"],
                     "same_output": _same(alone["text"], spec["text"]), "accepted": spec["accepted"],
                     "tau": spec["tau"], "target": alone, "speculative": spec})
    accepted = [a for r in rows for a in r["accepted"]]
    histogram = [0] * (max(accepted, default=0) + 1)
    for a in accepted:
        histogram[a] += 1
    later = [a for r in rows for a in r["accepted"][1:]]
    histogram_later = [0] * (max(later, default=0) + 1)
    for a in later:
        histogram_later[a] += 1
    target_tps = _mean([r["target"]["tokens_per_s"] for r in rows])
    spec_tps = _mean([r["speculative"]["tokens_per_s"] for r in rows])
    return {"engine": "llama.cpp", "tau": mean_acceptance(histogram), "per_prompt": rows,
            "tau_after_first_step": mean_acceptance(histogram_later),
            "greedy_mismatches": sum(not r["same_output"] for r in rows),
            "tokens_per_s_target": target_tps, "tokens_per_s_speculative": spec_tps,
            "speedup": spec_tps / target_tps if target_tps and spec_tps else None}


def _same(a: str, b: str) -> bool:
    """The two greedy texts agree on the shorter one's length (speculative-simple may stop a block past -n)."""
    n = min(len(a), len(b))
    return n > 0 and a[:n] == b[:n]


def _mean(values: Sequence) -> float:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None
