"""vLLM decode speed with and without each drafter, batch 1, T = 0, the same prompts, in one run (docs/real-target.md).

    python bench/real_target_vllm_speed.py --target OUT/target --export OUT/run/export [--export NAME=DIR ...] \
        --prompts OUT/prompts_sharegpt_eval.jsonl --max-new-tokens 64 --out bench/results/real_target/vllm_speed.json
    python bench/real_target_vllm_speed.py --v2 ...   (DFlash2, DSpark, LiLiCorr exports: vLLM's V2 model runner)

Each prompt alone (batch 1) through vLLM's target without a drafter, then through vLLM speculating with each export;
the tokens/s are new tokens over the wall-clock seconds of the generate calls (prefill included; engine start and a
short warm-up request excluded), and each drafter's outputs must be the target's tokens (T = 0). Needs vLLM
(docs/vllm.md).
--v2 serves the target alone and every export with vLLM's V2 model runner, switched on on the CPU as
tests/vllm_v2_on_cpu.py does: its Triton kernels (input preparation, the speculator's, rejection sampling) then run
in Triton's interpreter, on both sides of the ratio; the V1 runner (the default) has no such kernels.
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
if "--v2" in sys.argv:  # before vLLM is imported (tests/vllm_v2_on_cpu.py says why)
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    from vllm_v2_on_cpu import switch_on_v2_runner

    switch_on_v2_runner()

from transformers import AutoTokenizer, GenerationConfig  # noqa: E402

from dflash_fast.evaluate.vllm import speculative_config  # noqa: E402
from dflash_fast.serve.engines import config_from_export  # noqa: E402
from dflash_fast.serve.export import read_export_config  # noqa: E402
from dflash_fast.target.prompts import encode_prompt, eos_token_ids, read_prompts  # noqa: E402
from dflash_fast.target.vllm import generate, load_engine  # noqa: E402


def timed(llm, encoded, max_new_tokens, eos):
    """Each prompt alone through `llm` -> (its new tokens, the seconds of the generate calls). A short request first,
    not counted: an engine's first request pays one-time costs (the first run of every decode and verify shape)."""
    generate(llm, [encoded[0][:16]], 4, eos)
    tokens, seconds = [], 0.0
    for ids in encoded:
        t0 = time.perf_counter()
        _, out = generate(llm, [ids], max_new_tokens, eos)
        seconds += time.perf_counter() - t0
        tokens.append(out[0])
    return tokens, seconds


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--export", action="append", required=True, help="DIR or NAME=DIR, repeated: one row each")
    p.add_argument("--prompts", required=True)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--v2", action="store_true", help="vLLM's V2 model runner for every engine of the run")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(a.target)
    eos = eos_token_ids(GenerationConfig.from_pretrained(a.target), tokenizer)
    encoded = [encode_prompt(tokenizer, prompt) for prompt in read_prompts(a.prompts, a.num_prompts)]
    plain = load_engine(a.target, None, "fp32", 2048)
    base, base_s = timed(plain, encoded, a.max_new_tokens, eos)
    del plain
    report = {
        "prompts": len(encoded), "max_new_tokens": a.max_new_tokens, "batch": 1, "temperature": 0.0,
        "target": a.target, "runner": "V2" if a.v2 else "V1", "new_tokens": sum(map(len, base)),
        "tokens_per_s_target_alone": sum(map(len, base)) / base_s, "drafters": {},
    }
    for spec in a.export:
        name, export = spec.split("=", 1) if "=" in spec else (spec, spec)
        cfg = config_from_export(read_export_config(export))
        spec_engine = load_engine(a.target, speculative_config(export, cfg), "fp32", 2048)
        fast, fast_s = timed(spec_engine, encoded, a.max_new_tokens, eos)
        del spec_engine
        report["drafters"][name] = {
            "export": export, "same_tokens": base == fast,
            "tokens_per_s_with_drafter": sum(map(len, fast)) / fast_s,
            "speedup": base_s / fast_s * sum(map(len, fast)) / max(sum(map(len, base)), 1),
        }
        print(name, json.dumps(report["drafters"][name]), flush=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
