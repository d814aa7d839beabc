#!/bin/bash
# online_cost.sh: 12 steps of configs/smollm2-135m.yaml from run 3's store, then the same 12 from its JSONL with the
# target in the job (data.source=online), one after the other on the quiet machine; per-step times in metrics.jsonl
cd /work/wt/s15
export TRITON_INTERPRET=1 HF_HUB_OFFLINE=1 PYTHONPATH=/work/wt/s15
O=/work/rt_out/s15/online_cost; D=/work/rt_out/s14/data; mkdir -p $O
COMMON="model.target=/work/rt_out/run2/target schedule.steps=12 logging.every=1 checkpoint.every=0 seed=0"
/usr/bin/time -f "%e s wall" /work/venvs/int11/bin/python train.py --config configs/smollm2-135m.yaml output_dir=$O/store \
  data.store=$D/store800 $COMMON > $O/store.log 2>&1; tail -1 $O/store.log
/usr/bin/time -f "%e s wall" /work/venvs/int11/bin/python train.py --config configs/smollm2-135m.yaml output_dir=$O/online \
  data.source=online data.jsonl=$D/train800.jsonl model.layer_ids=1,8,14,20,27 data.online.max_seq_len=512 \
  data.online.dtype=bf16 $COMMON > $O/online.log 2>&1; tail -1 $O/online.log
