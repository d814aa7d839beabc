#!/bin/bash
cd /work/wt/rtrun
export PYTHONPATH=/work/wt/rtrun
STEPS=${1:-80}
date -u +%s > /work/rt_out/run2/train.start
nice -n 10 /work/venvs/realtarget/bin/python -m deepspeed.launcher.runner --num_gpus 1 --master_port 42611 \
  /work/wt/rtrun/train.py --config configs/smollm2-135m.yaml output_dir=/work/rt_out/run2/run \
  model.target=/work/rt_out/run2/target data.store=/work/rt_out/run2/store schedule.steps=$STEPS \
  checkpoint.every=10 logging.every=5
echo rc=$?
date -u +%s > /work/rt_out/run2/train.end
