#!/usr/bin/env bash
# ONE prepared run on a lent GPU (H200): carried wheels, the package, every GPU test, every benchmark.
#
#   bash bench/fetch_wheels.sh                       # here, before the device session
#   device run: command "bash bench/gpu_suite.sh", carry ["bench/wheels"], timeout_s 600
#
#   bash bench/gpu_suite.sh [PART ...]               # PART: tests step lm_head_loss attention fc_concat extract step_topk
#                                                    #       online vllm (default: all, in that order)
# Each part has its own time cap and none starts past SUITE_BUDGET_S (default 510 s), so the
# command ends inside the device's 10-minute limit and one hang costs only its own cap. A part
# cut by the budget is reported "skipped"; run it in a second call, e.g. `bash bench/gpu_suite.sh
# attention fc_concat`.
# Results: RESULTS (default bench/results/gpu-<UTC date>) gets every benchmark's .json/.md/.png,
# pytest's log and junit XML, suite.log and summary.md. With OUT set (the device tool sets it and
# returns at most 8 files), they are also packed into $OUT/gpu-<date>.tar.gz, with summary.md
# and suite.log beside it; unpack with `tar xzf gpu-<date>.tar.gz -C bench/results`.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
BUDGET=${SUITE_BUDGET_S:-510}
STAMP=$(date -u +%Y-%m-%d)
RESULTS=${RESULTS:-bench/results/gpu-$STAMP}
PY=${PYTHON:-python3}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec > >(tee -a "$RESULTS/suite.log") 2>&1

PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(tests step lm_head_loss attention fc_concat extract step_topk online vllm)
STATUS=()

# run_part NAME CAP_S CMD...: run CMD under `timeout`, at most CAP_S and never past the budget.
run_part() {
  local name=$1 cap=$2
  shift 2
  local left=$((BUDGET - ($(date +%s) - START)))
  if [ "$left" -lt 30 ]; then
    echo "== $name: skipped, ${left}s of the ${BUDGET}s budget left"
    STATUS+=("| $name | skipped (budget) | 0 |")
    return
  fi
  [ "$cap" -gt "$left" ] && cap=$left
  echo "== $name (cap ${cap}s): $*"
  local t0=$(date +%s)
  timeout -k 10 "$cap" "$@"
  local rc=$?
  local verdict="ok"
  [ "$rc" -ne 0 ] && verdict="exit $rc"
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && verdict="timed out at ${cap}s"
  STATUS+=("| $name | $verdict | $(($(date +%s) - t0)) |")
}

echo "== set-up"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>/dev/null || echo "no nvidia-smi"
if compgen -G "bench/wheels/*.whl" >/dev/null; then
  # --target keeps the image's own packages untouched; PYTHONPATH puts the carried ones first.
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site bench/wheels/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} \
    || echo "carried wheels did not install: liger / speculators / deepspeed rows will say 'not installed'"
else
  echo "no bench/wheels/*.whl carried: liger / speculators rows will say 'not installed' (run bench/fetch_wheels.sh here first)"
fi
if ! "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . ; then
  # kernels/ is installed as dflash_fast.kernels; without pip, a link in this throw-away copy does the same.
  echo "pip install -e . failed: linking dflash_fast/kernels -> kernels/"
  ln -sfn ../kernels dflash_fast/kernels
fi
"$PY" - <<'EOF'
import importlib.metadata as md
import torch
import dflash_fast.kernels
print("python", __import__("sys").version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA")
for dist in ("triton", "transformers", "liger-kernel", "speculators", "deepspeed", "pydantic", "pytest"):
    try:
        print(f"  {dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"  {dist} not installed")
EOF
PYTEST_TIMEOUT=()
"$PY" -c "import pytest_timeout" 2>/dev/null && PYTEST_TIMEOUT=(--timeout 120)

for part in "${PARTS[@]}"; do
  case "$part" in
    tests) run_part "pytest -m gpu" 150 "$PY" -m pytest -q -m gpu tests/ -p no:cacheprovider \
             --continue-on-collection-errors "${PYTEST_TIMEOUT[@]}" --junitxml "$RESULTS/pytest_gpu.xml" ;;
    step) run_part "bench_step kl" 230 "$PY" bench/bench_step.py --loss kl --out "$RESULTS" ;;
    extract) run_part "bench_extract 8b" 100 "$PY" bench/bench_extract.py --model 8b --out "$RESULTS" ;;
    attention) run_part "bench_attention" 100 "$PY" bench/bench_attention.py --out "$RESULTS" ;;
    lm_head_loss) run_part "bench_lm_head_loss" 90 "$PY" bench/bench_lm_head_loss.py --out "$RESULTS" ;;
    fc_concat) run_part "bench_fc_concat" 70 "$PY" bench/bench_fc_concat.py --out "$RESULTS" ;;
    step_topk) run_part "bench_step kl_topk" 80 "$PY" bench/bench_step.py --loss kl_topk --impls triton,eager --out "$RESULTS" ;;
    online) run_part "bench_online 1.7b" 300 "$PY" bench/bench_online.py --model 1.7b --tmp /tmp --out "$RESULTS" ;;
    # vLLM proper (V2 runner) serving trained exports against our evaluator; needs vLLM in the image (the carried
    # wheels cannot bring it): without it the part says so instead of passing.
    vllm) run_part "vllm in the loop" 300 env DFLASH_REQUIRE_VLLM=1 "$PY" -m pytest -q tests/test_vllm.py \
            -p no:cacheprovider --junitxml "$RESULTS/pytest_vllm.xml" ;;
    *) echo "unknown part $part (parts: tests step lm_head_loss attention fc_concat extract step_topk online vllm)"; STATUS+=("| $part | unknown part | 0 |") ;;
  esac
done

{
  echo "# GPU suite $STAMP ($(($(date +%s) - START)) s)"
  echo
  echo "| part | result | seconds |"
  echo "|---|---|---|"
  printf '%s\n' "${STATUS[@]}"
  echo
  "$PY" bench/harness.py "$RESULTS"
} >"$RESULTS/summary.md"
cat "$RESULTS/summary.md"

if [ -n "${OUT:-}" ] && [ "$OUT" != "$RESULTS" ]; then
  mkdir -p "$OUT"
  tar czf "$OUT/gpu-$STAMP.tar.gz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
  cp "$RESULTS/summary.md" "$RESULTS/suite.log" "$OUT/"
  echo "packed into $OUT/gpu-$STAMP.tar.gz"
fi
