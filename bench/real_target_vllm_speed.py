"""vLLM decode speed with and without each drafter, batch 1, T = 0, the same prompts, in one run (docs/real-target.md).

    python bench/real_target_vllm_speed.py --target OUT/target --export OUT/run/export [--export NAME=DIR ...] \
        --prompts OUT/prompts_sharegpt_eval.jsonl --max-new-tokens 64 --out bench/results/real_target/vllm_speed.json
    python bench/real_target_vllm_speed.py --v2 ...   (DFlash2, DSpark, LiLiCorr exports: vLLM's V2 model runner)

Each prompt alone (batch 1) through vLLM's target without a drafter, then through vLLM speculating with each export;
the tokens/s are new tokens over the wall-clock seconds of the generate calls (prefill included; engine start and a
short warm-up request excluded), and each drafter's outputs must be the target's tokens (T = 0): evaluate/vllm.py
serving_speed, which `dflash-fast real-target` runs too. Needs vLLM (docs/vllm.md).
--v2 serves the target alone and every export with vLLM's V2 model runner, switched on on the CPU as
tests/vllm_v2_on_cpu.py does: its Triton kernels (input preparation, the speculator's, rejection sampling) then run
in Triton's interpreter, on both sides of the ratio; the V1 runner (the default) has no such kernels.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
if "--v2" in sys.argv:  # before vLLM is imported (tests/vllm_v2_on_cpu.py says why)
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    from vllm_v2_on_cpu import switch_on_v2_runner

    switch_on_v2_runner()

from dflash_fast.evaluate.vllm import serving_speed  # noqa: E402


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
    exports = dict(spec.split("=", 1) if "=" in spec else (spec, spec) for spec in a.export)
    report = serving_speed(a.target, exports, a.prompts, a.num_prompts, a.max_new_tokens)
    report["runner"] = "V2" if a.v2 else "V1"
    for name, row in report["drafters"].items():
        print(name, json.dumps(row), flush=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
