"""vLLM decode speed with and without a drafter, batch 1, T = 0, the same prompts, in one run (docs/real-target.md).

    python bench/real_target_vllm_speed.py --target OUT/target --export OUT/run/export \
        --prompts OUT/prompts_sharegpt_eval.jsonl --max-new-tokens 64 --out bench/results/real_target/vllm_speed.json

Each prompt alone (batch 1) through vLLM's target without a drafter, then through vLLM speculating with the export;
the tokens/s are new tokens over the wall-clock seconds of the generate calls (prefill included, engine start
excluded), and the outputs must be the same tokens (T = 0). Needs vLLM (docs/vllm.md).
"""
import argparse
import json
import time

from transformers import AutoTokenizer, GenerationConfig

from dflash_fast.evaluate.vllm import speculative_config
from dflash_fast.serve.engines import config_from_export
from dflash_fast.serve.export import read_export_config
from dflash_fast.target.prompts import encode_prompt, eos_token_ids, read_prompts
from dflash_fast.target.vllm import generate, load_engine


def timed(llm, encoded, max_new_tokens, eos):
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
    p.add_argument("--export", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(a.target)
    eos = eos_token_ids(GenerationConfig.from_pretrained(a.target), tokenizer)
    encoded = [encode_prompt(tokenizer, prompt) for prompt in read_prompts(a.prompts, a.num_prompts)]
    rows = {}
    plain = load_engine(a.target, None, "fp32", 2048)
    rows["target alone"] = timed(plain, encoded, a.max_new_tokens, eos)
    del plain
    cfg = config_from_export(read_export_config(a.export))
    spec = load_engine(a.target, speculative_config(a.export, cfg), "fp32", 2048)
    rows["with the drafter"] = timed(spec, encoded, a.max_new_tokens, eos)
    (base, base_s), (fast, fast_s) = rows["target alone"], rows["with the drafter"]
    report = {
        "prompts": len(encoded), "max_new_tokens": a.max_new_tokens, "batch": 1, "temperature": 0.0,
        "target": a.target, "export": a.export, "same_tokens": base == fast,
        "new_tokens": sum(map(len, base)),
        "tokens_per_s_target_alone": sum(map(len, base)) / base_s,
        "tokens_per_s_with_drafter": sum(map(len, fast)) / fast_s,
        "speedup": base_s / fast_s * sum(map(len, fast)) / max(sum(map(len, base)), 1),
    }
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
