#!/bin/bash
# table.sh ENGINE [--v2] RUN=EXPORT... : bench/real_target_table.py into /work/rt_out/s14/table
ENGINE=$1; shift
cd /work/wt/s14
export TRITON_INTERPRET=1 HF_HUB_OFFLINE=1 PYTHONPATH=/work/wt/s14
PY=/work/venvs/int11/bin/python
[ $ENGINE = vllm ] && PY=/work/venvs/lilicorr-vllm/bin/python
ARGS=()
for a in "$@"; do if [ "$a" = "--v2" ]; then ARGS+=(--v2); else ARGS+=(--run "$a"); fi; done
$PY bench/real_target_table.py $ENGINE --target /work/rt_out/run2/target \
  --sharegpt /work/rt_out/run2/prompts_sharegpt_eval.jsonl --humaneval /work/rt_out/run2/humaneval.jsonl \
  --num-prompts ${NP:-4} --max-new-tokens ${NT:-64} --temperatures ${TEMPS:-0 1} --out ${TOUT:-/work/rt_out/s14/table} "${ARGS[@]}"
