#!/bin/bash
# eval_lane2.sh FAM_sSEED... : as eval_lane.sh; seed 1's vLLM rows at T = 0 only (time)
ROOT=/work/rt_out/s14/t
while pgrep -f "real_target_table.py" > /dev/null; do sleep 10; done
for job in "$@"; do
  fam=${job%_s*}; seed=${job##*_s}
  while [ ! -f $ROOT/$job/train.end ]; do sleep 15; done
  EXP=$ROOT/$job/run/export
  [ -d $EXP ] || { echo "no export for $job"; continue; }
  OMP_NUM_THREADS=1 /work/notes/s14/table.sh ours $fam/$seed=$EXP
  V2=""; [ $fam != dflash ] && V2=--v2
  if [ $seed = 0 ]; then /work/notes/s14/table.sh vllm $V2 $fam/$seed=$EXP
  else TEMPS="0" /work/notes/s14/table.sh vllm $V2 $fam/$seed=$EXP; fi
done
