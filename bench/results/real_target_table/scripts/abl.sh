#!/bin/bash
# abl.sh NAME OVERRIDES...: run 3's DFlash seed-0 recipe (300-step schedule) with OVERRIDES, one thread, stopped after
# its step-100 checkpoint; then our evaluator on that checkpoint (ShareGPT, 4 x 64, T = 0) as curve_evals.sh did
NAME=$1; shift
O=/work/rt_out/s15/abl/$NAME; mkdir -p $O
cd /work/wt/s15
export TRITON_INTERPRET=1 HF_HUB_OFFLINE=1 PYTHONPATH=/work/wt/s15 OMP_NUM_THREADS=1
/work/venvs/int11/bin/python train.py --config configs/smollm2-135m.yaml output_dir=$O/run \
  model.target=/work/rt_out/run2/target data.store=/work/rt_out/s14/data/store800 schedule.steps=300 \
  checkpoint.every=100 checkpoint.keep_last=3 logging.every=10 seed=0 export=false "$@" > $O/train.log 2>&1 &
PID=$!
while [ ! -d $O/run/checkpoints/step00000100 ] && kill -0 $PID 2>/dev/null; do sleep 10; done
sleep 20; kill $PID 2>/dev/null; wait $PID 2>/dev/null
echo "stopped after step 100 $(date -u +%H:%M:%S)"
/work/venvs/int11/bin/dflash-fast eval --target /work/rt_out/run2/target --data /work/rt_out/run2/prompts_sharegpt_eval.jsonl \
  --drafter $O/run/checkpoints/step00000100 --num-prompts 4 --max-new-tokens 64 --no-baseline --out $O/eval_step100.json > $O/eval.log 2>&1
echo "evaluated $(date -u +%H:%M:%S) rc=$?"
