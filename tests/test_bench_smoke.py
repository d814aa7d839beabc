"""The end-to-end benchmarks run in --smoke mode on CPU and write sane results, so they cannot rot
before a GPU session; and the step's FLOP count matches PERF.md's reference accounting."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from launch_env import launch_env  # noqa: E402

from bench.bench_step import FULL, PEER_LOSS, SMOKE, make_batch, parse_args, step_flops, visible_pairs  # noqa: E402
from dflash_fast.drafter.eager import anchored_attention_mask  # noqa: E402
from dflash_fast.drafter.losses import LOSS_KINDS  # noqa: E402


def run_smoke(script, out_dir, *extra):
    """Run bench/<script> --smoke into out_dir and return its parsed JSON."""
    env = launch_env(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.join(REPO, "bench", script), "--smoke", "--out", str(out_dir), *extra]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}"
    names = [f for f in os.listdir(out_dir) if f.endswith(".json")]
    assert len(names) == 1, names
    with open(os.path.join(out_dir, names[0])) as f:
        return names[0], json.load(f)


def positive_finite(row, keys):
    bad = {k: row.get(k) for k in keys if not (isinstance(row.get(k), float) and math.isfinite(row[k]) and row[k] > 0)}
    assert not bad, f"{row.get('impl', row.get('path'))}: not positive finite numbers: {bad}"


@pytest.fixture(scope="module", params=["kl", "kl_topk"])
def step_run(request, tmp_path_factory):
    return request.param, run_smoke(
        "bench_step.py", tmp_path_factory.mktemp(f"step_{request.param}"), "--loss", request.param
    )


def test_step_accepts_every_loss_kind_the_config_accepts():
    """--loss takes loss.kind's values (losses.LOSS_KINDS and `auto`, which is kl: the synthetic row has `last`)."""
    for kind in LOSS_KINDS:
        assert parse_args(["--loss", kind]).loss == kind
    assert parse_args(["--loss", "auto"]).loss == "kl"
    assert set(PEER_LOSS) <= set(LOSS_KINDS)


def test_step_smoke_times_every_contender_or_says_why_not(step_run):
    loss, (name, result) = step_run
    assert name == f"step_{loss}_smoke.json"
    rows = {r["impl"]: r for r in result["rows"]}
    assert list(rows) == ["triton", "speculators", "liger", "eager"]
    for impl in ("triton", "eager"):
        positive_finite(
            rows[impl], ("step_ms", "anchors_per_s", "loss", "loss_step2", "tflop_per_step", "first_step_s")
        )
        assert rows[impl]["loss_kind"] == loss
    for impl in ("liger", "speculators"):
        assert "step_ms" in rows[impl] or rows[impl]["note"], rows[impl]
    assert {"shape", "flop_formula", "flops_by_part", "valid_anchors"} <= set(result["meta"])
    assert {"date", "device", "torch", "command"} <= set(result["environment"])


def test_step_smoke_triton_path_runs_the_kernels(step_run):
    _, (_, result) = step_run
    rows = {r["impl"]: r for r in result["rows"]}
    for impl in ("triton", "eager"):
        assert rows[impl]["backends"] == ",".join(
            f"{op}={impl}" for op in ("fc_concat", "anchored_attention", "lm_head_loss", "grouped_dynamic_conv"))


def test_step_smoke_triton_and_eager_losses_agree_before_and_after_an_update(step_run):
    _, (_, result) = step_run
    rows = {r["impl"]: r for r in result["rows"]}
    triton, eager = rows["triton"], rows["eager"]
    assert triton["loss"] == pytest.approx(eager["loss"], rel=1e-5)
    # The second step's loss sees the weights after backward + AdamW: it checks the gradients too.
    assert triton["loss_step2"] == pytest.approx(eager["loss_step2"], rel=1e-4)
    assert abs(triton["loss_step2"] - triton["loss"]) > 1e-3


def test_extract_smoke_reports_throughput_and_bytes_written(tmp_path):
    name, result = run_smoke("bench_extract.py", tmp_path)
    assert name == "extract_smoke.json"
    rows = {r["path"]: r for r in result["rows"]}
    assert list(rows) == ["bare forward", "forward + hidden", "extract (runner)", "extract + write"]
    for row in rows.values():
        positive_finite(row, ("tokens_per_s", "ms_per_batch", "ratio_vs_bare"))
    assert rows["bare forward"]["ratio_vs_bare"] == 1.0
    write = rows["extract + write"]
    positive_finite(write, ("gb_per_s",))
    # Smoke store: fp32 hidden [5, 32] + last [32], int32 id, bool mask, top-8 int32 ids + fp32 logits, fp32 lse.
    assert write["bytes_per_token"] == 5 * 32 * 4 + 32 * 4 + 4 + 1 + 8 * 4 + 8 * 4 + 4
    assert write["bytes_written"] == write["bytes_per_token"] * 2 * 64


def test_online_smoke_times_store_and_online_steps_side_by_side(tmp_path):
    name, result = run_smoke("bench_online.py", tmp_path)
    assert name == "online_smoke.json" and "never a performance claim" in result["meta"]["note"]
    rows = {r["path"]: r for r in result["rows"]}
    assert list(rows) == ["store", "online (in line)", "online (prefetch)"]
    for row in rows.values():
        positive_finite(row, ("step_ms", "drafter_ms", "tokens_per_s", "ratio_vs_store"))
    assert rows["store"]["target_forward_ms"] is None and rows["store"]["ratio_vs_store"] == 1.0
    for path in ("online (in line)", "online (prefetch)"):
        positive_finite(rows[path], ("target_forward_ms",))
    # In line, the step waits for the whole target forward; with prefetch it waits for at most that.
    assert rows["online (in line)"]["wait_ms"] >= rows["online (in line)"]["target_forward_ms"]


def test_visible_pairs_is_the_eager_mask_count_per_head():
    batch = make_batch(SMOKE, torch.float32, "cpu", seed=3)
    mask = anchored_attention_mask(batch["anchors"], batch["anchor_valid"], batch["document_ids"], SMOKE["B"])
    assert visible_pairs(batch, SMOKE["B"]) == int(mask.sum())


def test_step_flops_match_perf_md_at_the_reference_shape():
    # PERF.md, per row: drafter layers 15.8 T forward (x3 with backward), lm_head 10.2 T forward
    # (x2: input grad), teacher 10.2 T, attention ~0.21 T forward per layer at ~1550 visible keys
    # per query (x3.5 with backward, x5 layers); about 80 T in all.
    q = FULL["A"] * FULL["B"]
    parts = step_flops(FULL, pairs=1550 * q, teacher=True)
    assert parts["layers"] / 3 == pytest.approx(15.8e12, rel=0.01)
    assert parts["lm_head"] / 2 == pytest.approx(10.2e12, rel=0.01)
    assert parts["teacher"] == pytest.approx(10.2e12, rel=0.01)
    assert parts["attention"] / FULL["L"] / 3.5 == pytest.approx(0.21e12, rel=0.02)
    assert parts["total"] == pytest.approx(80e12, rel=0.06)
    assert step_flops(FULL, pairs=1550 * q, teacher=False)["total"] == pytest.approx(parts["total"] - parts["teacher"])
