#!/bin/bash
# queue.sh THREADS JOB... ; JOB = family_seed ; runs them one after another in this shell
source /work/notes/s14/families.sh
T=$1; shift
for job in "$@"; do
  fam=${job%_s*}; seed=${job##*_s}
  var=FAM_$fam
  OMP_NUM_THREADS=$T MKL_NUM_THREADS=$T /work/notes/s14/train_one.sh ${fam}_s$seed seed=$seed ${!var}
done
