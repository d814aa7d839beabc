#!/usr/bin/env bash
# ONE prepared run on a lent GPU (H200): carried wheels, the package, every GPU test, every benchmark.
#
#   bash bench/fetch_wheels.sh                       # here, before the device session
#   device run: command "bash bench/gpu_suite.sh", carry ["bench/wheels"], timeout_s 600
#
#   bash bench/gpu_suite.sh [--dry-run] [PART ...]   # PART: see ALL_PARTS below (default: all, in that order)
#
# Parts run in order of value per second (bench/README.md, "The GPU suite", has each one's cap and expected
# time): the first ~8 minutes give the headline, the training step side by side with speculators', then the
# loss and attention kernels against their floors; the rest follows. Each part has its own time cap and none
# starts past SUITE_BUDGET_S (default 510 s), so the command ends inside the device's 10-minute limit and one
# hang costs only its own cap. A part cut by the budget is reported "skipped"; run it in a second call, e.g.
# `bash bench/gpu_suite.sh fc_concat step_topk`.
#
# --dry-run: every part on this CPU at the smallest shapes (Triton interpreter, fp32, CUDA hidden), with the
# same scripts and flags: each benchmark gets --smoke added, `pytest -m gpu` collects and skips every GPU
# test, the vLLM parts collect their tests (which imports our modules) without running vLLM. No wheels,
# no pip. Every part must exit 0 and write a report file, and `harness.py --strict` must read every report
# with no failed row; otherwise it exits 1. tests/test_gpu_suite_dry_run.py runs it in CI (~1.5-3 min here).
#
# Results: RESULTS (default bench/results/gpu-<UTC date>; dry run: a fresh temporary folder) gets every
# benchmark's .json/.md/.png, pytest's log and junit XML, suite.log and summary.md. With OUT set (the device
# tool sets it and returns at most 8 files; the dry run uses RESULTS.out), they are also packed into
# $OUT/gpu-<date>.tar.gz, with summary.md and suite.log beside it; unpack with
# `tar xzf gpu-<date>.tar.gz -C bench/results`. Exit status: 1 when a part failed (dry run: or was skipped).
set -uo pipefail
cd "$(dirname "$0")/.."

# Value per second, highest first. A new part: a `case` line in run_named_part below, and its name here.
ALL_PARTS=(step lm_head_loss attention step_smollm2 tests fc_concat step_topk dflash2 lilicorr extract online vllm vllm_serve)

DRY=0
PARTS=()
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,26p' "$0"; echo "parts: ${ALL_PARTS[*]}"; exit 0 ;;
    -*) echo "unknown option $arg (options: --dry-run, --help)"; exit 2 ;;
    *) PARTS+=("$arg") ;;
  esac
done
[ ${#PARTS[@]} -eq 0 ] && PARTS=("${ALL_PARTS[@]}")

START=$(date +%s)
STAMP=$(date -u +%Y-%m-%d)
PY=${PYTHON:-python3}
SMOKE=()
if [ "$DRY" -eq 1 ]; then
  # The dry run's budget only keeps a wedged part from hanging CI: every part must run, none is cut.
  BUDGET=${SUITE_BUDGET_S:-1200}
  RESULTS=${RESULTS:-$(mktemp -d "${TMPDIR:-/tmp}/gpu-suite-dry-run.XXXXXX")}
  OUT=${OUT:-$RESULTS.out}
  SMOKE=(--smoke)
  # Before any interpreter starts: a @triton.jit module reads TRITON_INTERPRET when it is imported.
  export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
  BUDGET=${SUITE_BUDGET_S:-510}
  RESULTS=${RESULTS:-bench/results/gpu-$STAMP}
fi
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec > >(tee -a "$RESULTS/suite.log") 2>&1

STATUS=()
FAILED=0

# run_part NAME CAP_S CMD...: run CMD under `timeout`, at most CAP_S and never past the budget. A part that
# exits 0 but writes nothing into RESULTS has not reported, and fails.
run_part() {
  local name=$1 cap=$2
  shift 2
  local left=$((BUDGET - ($(date +%s) - START)))
  if [ "$left" -lt 30 ]; then
    echo "== $name: skipped, ${left}s of the ${BUDGET}s budget left"
    STATUS+=("| $name | skipped (budget) | 0 |")
    [ "$DRY" -eq 1 ] && FAILED=1
    return
  fi
  [ "$cap" -gt "$left" ] && cap=$left
  echo "== $name (cap ${cap}s): $*"
  local t0 stamp
  t0=$(date +%s)
  stamp=$(mktemp)
  timeout -k 10 "$cap" "$@"
  local rc=$?
  local verdict="ok"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    verdict="timed out at ${cap}s"
  elif [ "$rc" -ne 0 ]; then
    verdict="exit $rc"
  elif [ -z "$(find "$RESULTS" -type f -newer "$stamp" ! -name suite.log -print -quit)" ]; then
    verdict="wrote no report into $RESULTS"
  fi
  rm -f "$stamp"
  [ "$verdict" != "ok" ] && FAILED=1
  echo "== $name: $verdict"
  STATUS+=("| $name | $verdict | $(($(date +%s) - t0)) |")
}

# bench_part NAME CAP SCRIPT [FLAG ...]: bench/SCRIPT with the GPU run's flags; the dry run adds --smoke, so
# the same flags are parsed and the same modules imported, at tiny fp32 shapes on the CPU.
bench_part() {
  local name=$1 cap=$2 script=$3
  shift 3
  run_part "$name" "$cap" "$PY" "bench/$script" "$@" --out "$RESULTS" "${SMOKE[@]}"
}

# vllm_part NAME CAP TEST_FILE...: vLLM proper in the loop; DFLASH_REQUIRE_VLLM=1 makes a missing vLLM a failure,
# not a skip. The dry run collects the tests (importing our modules; the flag stops pytest skipping the module
# when vLLM is absent) and runs none: vLLM on a CPU is .ci/run's second venv's job, and takes minutes.
vllm_part() {
  local name=$1 cap=$2
  shift 2
  local collect=()
  if [ "$DRY" -eq 1 ]; then
    collect=(--collect-only)
    "$PY" -c "import vllm" 2>/dev/null || echo "== $name: vLLM is not installed here: its tests are collected, not run"
  fi
  run_part "$name" "$cap" env DFLASH_REQUIRE_VLLM=1 "$PY" -m pytest -q "$@" -p no:cacheprovider "${collect[@]}" \
    --junitxml "$RESULTS/pytest_$name.xml"
}

run_named_part() {
  case "$1" in
    # --- the headline (~7 minutes): our step vs speculators' at the Qwen3-8B shapes, then the kernels' floors
    step) bench_part "bench_step kl" 230 bench_step.py --loss kl ;;
    lm_head_loss) bench_part "bench_lm_head_loss" 90 bench_lm_head_loss.py ;;
    attention) bench_part "bench_attention" 100 bench_attention.py ;;
    # the real target's drafter (SmolLM2-135M-Instruct, docs/real-target.md), ours vs speculators at bf16
    step_smollm2) bench_part "bench_step smollm2" 150 bench_step.py --loss kl --shape smollm2-135m ;;
    # --- the rest
    tests) run_part "pytest -m gpu" 150 "$PY" -m pytest -q -m gpu tests/ -p no:cacheprovider \
             --continue-on-collection-errors "${PYTEST_TIMEOUT[@]}" --junitxml "$RESULTS/pytest_gpu.xml" ;;
    fc_concat) bench_part "bench_fc_concat" 70 bench_fc_concat.py ;;
    step_topk) bench_part "bench_step kl_topk" 80 bench_step.py --loss kl_topk --impls triton,eager ;;
    extract) bench_part "bench_extract 8b" 100 bench_extract.py --model 8b ;;
    online) bench_part "bench_online 1.7b" 300 bench_online.py --model 1.7b --tmp /tmp ;;
    # vLLM proper (V2 runner) serving trained exports against our evaluator; the carried wheels cannot bring
    # vLLM, so without it in the image these parts fail and say so.
    vllm) vllm_part vllm 300 tests/test_vllm.py tests/test_vllm_eval.py tests/test_vllm_lilicorr.py tests/test_vllm_trust.py tests/test_vllm_real_target.py ;;
    vllm_serve) vllm_part vllm_serve 300 tests/test_vllm_extract.py tests/test_vllm_serve.py tests/test_vllm_serve_replicas.py ;;
    # DFlash2's head (kl + the candidate selector): the fused pass with its top-K against the eager twin
    dflash2) bench_part "bench_lm_head_loss dflash2" 90 bench_lm_head_loss.py --dflash2 ;;
    # LiLiCorr's lattice head (forward, ModelOpt's lattice loss, backward) on the Qwen3-8B drafter, Triton / eager
    lilicorr) bench_part "bench_step lilicorr" 120 bench_step.py --loss kl --family lilicorr --impls triton,eager ;;
    # --- NEW PARTS GO HERE: `name) bench_part "label" CAP_S bench_x.py --gpu-flags ;;` for a benchmark (it must
    # take --out and --smoke and write <name>.json through harness.write_results), run_part for anything else;
    # then put the name into ALL_PARTS where its value per second places it, with its cap and expected time
    # in bench/README.md. tests/test_gpu_suite_dry_run.py then runs it in CI.
    *) echo "unknown part $1 (parts: ${ALL_PARTS[*]})"; STATUS+=("| $1 | unknown part | 0 |"); FAILED=1 ;;
  esac
}

echo "== set-up$([ "$DRY" -eq 1 ] && echo " (dry run: CPU, Triton interpreter, smallest shapes; results in $RESULTS)")"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>/dev/null || echo "no nvidia-smi"
if [ "$DRY" -eq 1 ]; then
  echo "dry run: no carried wheels and no pip install; $PY's own packages are used"
elif compgen -G "bench/wheels/*.whl" >/dev/null; then
  # --target keeps the image's own packages untouched; PYTHONPATH puts the carried ones first.
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site bench/wheels/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} \
    || echo "carried wheels did not install: liger / speculators / deepspeed rows will say 'not installed'"
else
  echo "no bench/wheels/*.whl carried: liger / speculators rows will say 'not installed' (run bench/fetch_wheels.sh here first)"
fi
if [ "$DRY" -eq 0 ] && ! "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . ; then
  # kernels/ is installed as dflash_fast.kernels; without pip, a link in this throw-away copy does the same.
  echo "pip install -e . failed: linking dflash_fast/kernels -> kernels/"
  ln -sfn ../kernels dflash_fast/kernels
fi
if ! "$PY" - <<'EOF'
import importlib.metadata as md
import torch
import dflash_fast.kernels
print("python", __import__("sys").version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA")
for dist in ("triton", "transformers", "liger-kernel", "speculators", "deepspeed", "pydantic", "pytest", "vllm"):
    try:
        print(f"  {dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"  {dist} not installed" + (": bench_step's speculators row says so" if dist == "speculators" else ""))
EOF
then
  STATUS+=("| set-up | import dflash_fast.kernels failed | 0 |")
  FAILED=1
fi
PYTEST_TIMEOUT=()
"$PY" -c "import pytest_timeout" 2>/dev/null && PYTEST_TIMEOUT=(--timeout 120)

for part in "${PARTS[@]}"; do
  run_named_part "$part"
done

STRICT=()
[ "$DRY" -eq 1 ] && STRICT=(--strict)
(
  echo "# GPU suite $STAMP$([ "$DRY" -eq 1 ] && echo " (dry run on CPU: times are no claim)") ($(($(date +%s) - START)) s)"
  echo
  echo "| part | result | seconds |"
  echo "|---|---|---|"
  printf '%s\n' "${STATUS[@]}"
  echo
  "$PY" bench/harness.py "${STRICT[@]}" "$RESULTS" || { echo; echo "harness.py ${STRICT[*]}: the reports above are not fit to summarise"; exit 1; }
) >"$RESULTS/summary.md" || FAILED=1
cat "$RESULTS/summary.md"

if [ -n "${OUT:-}" ] && [ "$OUT" != "$RESULTS" ]; then
  mkdir -p "$OUT"
  tar czf "$OUT/gpu-$STAMP.tar.gz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
  cp "$RESULTS/summary.md" "$RESULTS/suite.log" "$OUT/"
  echo "packed into $OUT/gpu-$STAMP.tar.gz"
fi
[ "$FAILED" -eq 0 ] && echo "== suite: every part ok" || echo "== suite: a part failed (summary.md)"
exit "$FAILED"
