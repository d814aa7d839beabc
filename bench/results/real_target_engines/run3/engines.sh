#!/bin/bash
# engines.sh FAM [--vllm-v2]: bench/real_target_engines.py for the run-3 seed-0 drafter FAM, 4 prompts x 64 tokens
FAM=$1; shift
cd /work/wt/s15
export TRITON_INTERPRET=1 HF_HUB_OFFLINE=1 PYTHONPATH=/work/wt/s15
R=/work/rt_out/run2; S=/work/rt_out/s15
/work/venvs/int11/bin/python bench/real_target_engines.py --target $R/target --export /work/rt_out/s14/t/${FAM}_s0/run/export \
  --target-gguf /work/rt_out/llama/target-f32.gguf --draft-gguf $S/llama/${FAM}_s0-f32.gguf \
  --sharegpt $R/prompts_sharegpt_eval.jsonl --humaneval $R/humaneval.jsonl --num-prompts 4 --max-new-tokens 64 \
  --threads 1 2 --ours $S/ours/${FAM}_s0_sharegpt.json $S/ours/${FAM}_s0_humaneval.json \
  --vllm-python /work/venvs/lilicorr-vllm/bin/python --out $S/engines/$FAM "$@"
