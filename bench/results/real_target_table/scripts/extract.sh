#!/bin/bash
cd /work/wt/s14
export PYTHONPATH=/work/wt/s14 HF_HUB_OFFLINE=1
ENGINE=${1:-vllm}
date -u +%s > /work/rt_out/s14/data/extract.start
/work/venvs/lilicorr-vllm/bin/python -m dflash_fast.cli extract --engine $ENGINE --target /work/rt_out/run2/target \
  --data /work/rt_out/s14/data/train800.jsonl --out /work/rt_out/s14/data/store800 --dtype bf16 --max-seq-len 512 --batch-tokens 8192
echo rc=$?
date -u +%s > /work/rt_out/s14/data/extract.end
