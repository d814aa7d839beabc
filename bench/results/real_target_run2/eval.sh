#!/bin/bash
# eval.sh DRAFTER N TOKENS
cd /work/wt/rtrun
export PYTHONPATH=/work/wt/rtrun
D=${1:-/work/rt_out/run2/run/export}; N=${2:-4}; M=${3:-64}
O=/work/rt_out/run2
s=$(date -u +%s)
nice -n 10 /work/venvs/realtarget/bin/dflash-fast eval --target $O/target --drafter $D \
  --data $O/prompts_sharegpt_eval.jsonl --num-prompts $N --max-new-tokens $M --out $O/eval_sharegpt.json
echo rc=$? sharegpt_s=$(( $(date -u +%s) - s )) | tee -a $O/eval.times
s=$(date -u +%s)
nice -n 10 /work/venvs/realtarget/bin/dflash-fast eval --target $O/target --drafter $D \
  --benchmark humaneval=$O/humaneval.jsonl --num-prompts $N --max-new-tokens $M --out $O/eval_humaneval.json
echo rc=$? humaneval_s=$(( $(date -u +%s) - s )) | tee -a $O/eval.times
