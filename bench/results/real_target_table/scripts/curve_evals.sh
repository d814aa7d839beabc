#!/bin/bash
C=/work/rt_out/s14/t/dflash_s0/run/checkpoints
cd /work/wt/s14
export TRITON_INTERPRET=1 HF_HUB_OFFLINE=1 PYTHONPATH=/work/wt/s14 OMP_NUM_THREADS=1
for s in 100 200; do
  /work/venvs/int11/bin/dflash-fast eval --target /work/rt_out/run2/target --drafter $C/step00000$s \
    --data /work/rt_out/run2/prompts_sharegpt_eval.jsonl --num-prompts 4 --max-new-tokens 64 --no-baseline \
    --out /work/rt_out/s14/curve_dflash0_step$s.json
done
