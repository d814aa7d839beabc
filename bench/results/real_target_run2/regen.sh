#!/bin/bash
cd /work/wt/rtrun
export PYTHONPATH=/work/wt/rtrun
date -u +%s > /work/rt_out/run2/regen.start
/usr/bin/time -v nice -n 10 /work/venvs/realtarget-vllm/bin/dflash-fast regenerate --engine vllm \
  --target /work/rt_out/run2/target --data /work/rt_out/run2/prompts_train.jsonl \
  --out /work/rt_out/run2/train.jsonl --batch-size 50 --max-new-tokens 128 --num-prompts 300
date -u +%s > /work/rt_out/run2/regen.end
