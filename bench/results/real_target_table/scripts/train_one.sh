#!/bin/bash
# usage: train_one.sh NAME OVERRIDES... ; trains configs/smollm2-135m.yaml on $STORE for $STEPS steps into $ROOT/NAME
NAME=$1; shift
ROOT=${ROOT:-/work/rt_out/s14/t}
OUT=$ROOT/$NAME
mkdir -p $OUT
cd /work/wt/s14
export TRITON_INTERPRET=1 HF_HUB_OFFLINE=1 PYTHONPATH=/work/wt/s14
date -u +%s > $OUT/train.start
/work/venvs/int11/bin/python train.py --config configs/smollm2-135m.yaml output_dir=$OUT/run \
  model.target=/work/rt_out/run2/target data.store=${STORE:-/work/rt_out/s14/data/store800} schedule.steps=${STEPS:-300} \
  checkpoint.every=100 checkpoint.keep_last=3 logging.every=10 "$@" > $OUT/train.log 2>&1
echo rc=$? >> $OUT/train.log
date -u +%s > $OUT/train.end
