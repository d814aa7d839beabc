#!/bin/bash
# speed.sh OUT.json [--v2] NAME=EXPORT... : bench/real_target_vllm_speed.py, 4 held-out ShareGPT prompts x 64 tokens
OUT=$1; shift
cd /work/wt/s15
export HF_HUB_OFFLINE=1 PYTHONPATH=/work/wt/s15
ARGS=(); for a in "$@"; do if [ "$a" = "--v2" ]; then ARGS+=(--v2); else ARGS+=(--export "$a"); fi; done
/work/venvs/lilicorr-vllm/bin/python bench/real_target_vllm_speed.py --target /work/rt_out/run2/target \
  --prompts /work/rt_out/run2/prompts_sharegpt_eval.jsonl --num-prompts 4 --max-new-tokens 64 --out $OUT "${ARGS[@]}"
