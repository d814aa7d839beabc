#!/bin/bash
cd /work/wt/rtrun
export PYTHONPATH=/work/wt/rtrun
date -u +%s > /work/rt_out/run2/extract.start
nice -n 10 /work/venvs/realtarget/bin/dflash-fast extract --target /work/rt_out/run2/target \
  --data /work/rt_out/run2/train.jsonl --out /work/rt_out/run2/store --dtype bf16 --max-seq-len 512 --batch-tokens 4096
echo rc=$?
date -u +%s > /work/rt_out/run2/extract.end
