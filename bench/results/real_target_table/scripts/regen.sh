#!/bin/bash
cd /work/wt/s14
export PYTHONPATH=/work/wt/s14 HF_HUB_OFFLINE=1
date -u +%s > /work/rt_out/s14/data/regen.start
/usr/bin/time -v /work/venvs/lilicorr-vllm/bin/python -m dflash_fast.cli regenerate --engine vllm \
  --target /work/rt_out/run2/target --data /work/rt_out/s14/data/prompts_more.jsonl \
  --out /work/rt_out/s14/data/train_more.jsonl --batch-size 100 --max-new-tokens 128
date -u +%s > /work/rt_out/s14/data/regen.end
