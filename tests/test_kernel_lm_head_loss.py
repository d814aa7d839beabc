"""The fused norm + lm_head + loss kernel equals its eager twin (dflash_fast.eager.lm_head_loss).

CPU runs go through the Triton interpreter (tests/conftest.py) in fp32 and fp16 with
small H and V; bf16 numerics are checked on a GPU against an fp32 eager reference.
Both gradient strategies are checked; "store" only differs for the kinds with a full
teacher, and processes 16-row chunks under the interpreter, so N = 37 is 16 + 16 + 5.
"""
import functools
import json
import os
import subprocess
import sys

import dflash_fast.kernels.lm_head_loss as kernel
import pytest
import torch
import torch.nn.functional as F
import triton
from dflash_fast.kernels.lm_head_loss import lm_head_loss

from dflash_fast import eager, ops

EPS = 1e-6
# Max |kernel - eager| relative to max |eager|, per dtype: fp16 eager rounds logits and
# dlogits to fp16, the kernel keeps logits in fp32.
GRAD_TOL = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}
LOSS_TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (kind, stored labels?) -- every path through the kernel.
KIND_CASES = [("kl", False), ("ce", False), ("ce", True), ("ce_data", True), ("kl_topk", False)]
TEACHER_CASES = [("kl", False), ("ce", False)]  # the kinds the store strategy changes
# (kind, stored labels?, strategy)
STRATEGY_CASES = [case + ("recompute",) for case in KIND_CASES] + [case + ("store",) for case in TEACHER_CASES]


def kernel_with(strategy):
    return functools.partial(lm_head_loss, strategy=strategy)


def make_inputs(n=37, hid=64, v=257, k=5, dtype=torch.float32, seed=0, w_scale=0.3, lm_head_grad=True):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)
    weights = torch.rand(n, generator=gen) + 0.5
    weights[::4] = 0  # masked slots
    teacher_logits = 2 * rand(n, v)
    top = teacher_logits.topk(k, dim=-1)
    to = lambda x: x.to(DEVICE)
    return dict(
        h=to(rand(n, hid).to(dtype)).requires_grad_(),
        norm_weight=to((1 + 0.1 * rand(hid)).to(dtype)).requires_grad_(),
        lm_head_weight=to((w_scale * rand(v, hid)).to(dtype)).requires_grad_(lm_head_grad),
        weights=to(weights),
        last=to(rand(n, hid).to(dtype)),
        final_norm_weight=to((1 + 0.1 * rand(hid)).to(dtype)),
        labels=to(torch.randint(0, v, (n,), generator=gen)),
        topk_ids=to(top.indices),
        topk_logits=to(top.values),
        topk_lse=to(teacher_logits.logsumexp(-1)),
    )


def run(fn, inputs, kind, stored_labels=True, normalizer=20.0):
    """Loss output and the gradients of (h, norm_weight, lm_head_weight) for one call."""
    params = [inputs["h"], inputs["norm_weight"], inputs["lm_head_weight"]]
    for p in params:
        p.grad = None
    kwargs = {k: v for k, v in inputs.items() if k not in ("h", "norm_weight", "lm_head_weight", "weights")}
    if not stored_labels:
        kwargs["labels"] = None
    out = fn(params[0], params[1], params[2], inputs["weights"], kind, normalizer, EPS, **kwargs)
    out.loss.backward()
    return out, [None if p.grad is None else p.grad.clone() for p in params]


def fp32_argmax(x, norm_weight, lm_head_weight):
    """Argmax of fp32 logits from the normed states in their own dtype: the kernel's exact target."""
    return F.linear(eager.rms_norm(x, norm_weight, EPS).float(), lm_head_weight.float()).argmax(-1)


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


def assert_matches(got, ref, dtype, check_argmax=True, grad_tol=None):
    (out, grads), (ref_out, ref_grads) = got, ref
    grad_tol = GRAD_TOL[dtype] if grad_tol is None else grad_tol
    tol = LOSS_TOL[dtype] * max(1.0, abs(ref_out.loss.item()))
    assert abs(out.loss.item() - ref_out.loss.item()) <= tol, (out.loss.item(), ref_out.loss.item())
    assert (out.kl is None) == (ref_out.kl is None)
    if ref_out.kl is not None:
        assert abs(out.kl.item() - ref_out.kl.item()) <= tol, (out.kl.item(), ref_out.kl.item())
    if check_argmax:
        assert torch.equal(out.draft_argmax, ref_out.draft_argmax)
        assert torch.equal(out.teacher_argmax, ref_out.teacher_argmax)
    for name, g, r in zip(("dh", "dnorm", "dlm_head"), grads, ref_grads):
        assert (g is None) == (r is None), name
        if r is not None:
            assert g.dtype == r.dtype and g.shape == r.shape, name
            assert rel_err(g, r) <= grad_tol, (name, rel_err(g, r))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind,stored_labels,strategy", STRATEGY_CASES)
def test_loss_metrics_argmax_and_grads_match_eager(kind, stored_labels, strategy, dtype):
    inputs = make_inputs(dtype=dtype)
    got = run(kernel_with(strategy), inputs, kind, stored_labels)
    # fp16 eager rounds logits to fp16 and breaks near-ties there; the kernel's argmaxes
    # are those of fp32 logits, so the teacher-argmax ce reference gets those as labels.
    draft_ref = fp32_argmax(inputs["h"], inputs["norm_weight"], inputs["lm_head_weight"])
    assert torch.equal(got[0].draft_argmax, draft_ref)
    if kind == "ce" and not stored_labels:
        teacher_ref = fp32_argmax(inputs["last"], inputs["final_norm_weight"], inputs["lm_head_weight"])
        assert torch.equal(got[0].teacher_argmax, teacher_ref)
        if dtype != torch.float32:
            inputs["labels"], stored_labels = teacher_ref, True
    ref = run(eager.lm_head_loss, inputs, kind, stored_labels)
    assert_matches(got, ref, dtype, check_argmax=dtype == torch.float32)
    if kind != "ce" or stored_labels:
        assert torch.equal(got[0].teacher_argmax, ref[0].teacher_argmax)


@pytest.mark.parametrize(
    "kind,stored_labels,strategy",
    [("kl", False, "recompute"), ("kl_topk", False, "recompute"), ("ce", True, "recompute"), ("kl", False, "store")],
)
def test_vocab_not_a_multiple_of_the_tile_nor_the_chunk(kind, stored_labels, strategy):
    inputs = make_inputs(n=70, hid=48, v=601, k=3, seed=1)  # store: 4 chunks of 16 rows and one of 6
    got = run(kernel_with(strategy), inputs, kind, stored_labels)
    assert_matches(got, run(eager.lm_head_loss, inputs, kind, stored_labels), torch.float32)


@pytest.mark.parametrize("strategy", kernel.STRATEGIES)
def test_zero_weight_rows_get_no_gradient(strategy):
    inputs = make_inputs()
    (_, (dh, _, _)) = run(kernel_with(strategy), inputs, "kl", stored_labels=False)
    masked = inputs["weights"] == 0
    assert masked.any() and (dh[masked] == 0).all() and (dh[~masked] != 0).any(dim=-1).all()


@pytest.mark.parametrize("kind,stored_labels,strategy", STRATEGY_CASES)
def test_all_masked_input_gives_zero_loss_and_zero_grads(kind, stored_labels, strategy):
    inputs = make_inputs()
    inputs["weights"] = torch.zeros_like(inputs["weights"])
    out, grads = run(kernel_with(strategy), inputs, kind, stored_labels, normalizer=0.0)
    assert out.loss.item() == 0.0
    assert out.kl is None or out.kl.item() == 0.0
    assert all(torch.count_nonzero(g) == 0 for g in grads)


@pytest.mark.parametrize("kind,stored_labels,strategy", STRATEGY_CASES)
def test_extreme_logits_do_not_overflow(kind, stored_labels, strategy):
    # |logits| in the thousands: exp() of any unshifted logit overflows fp32.
    inputs = make_inputs(w_scale=300.0, seed=2)
    with torch.no_grad():
        inputs["h"].mul_(1e4)
        inputs["last"].mul_(1e4)
        inputs["topk_logits"].mul_(1e3)
        inputs["topk_lse"].copy_(inputs["topk_logits"][:, 0] + 1e-3)
    got = run(kernel_with(strategy), inputs, kind, stored_labels)
    assert torch.isfinite(got[0].loss) and all(torch.isfinite(g).all() for g in got[1])
    # fp32 rounding of logits in the thousands (~3e-4) moves the unsaturated softmax entries
    # in eager and kernel alike: the gradients agree to that conditioning, not to 2e-5.
    assert_matches(got, run(eager.lm_head_loss, inputs, kind, stored_labels), torch.float32, grad_tol=2e-3)


@pytest.mark.parametrize("strategy", kernel.STRATEGIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_argmax_ties_resolve_to_smallest_index(dtype, strategy):
    # h = +-1 with eps = 0 and a unit norm weight normalise exactly; integer lm_head rows make
    # integer logits, so maxima tie exactly, across tiles and vocab splits.
    gen = torch.Generator().manual_seed(3)
    n, hid, v = 37, 16, 601
    signs = lambda: (torch.randint(0, 2, (n, hid), generator=gen) * 2 - 1).to(dtype).to(DEVICE)
    lm_head = torch.randint(-1, 2, (v, hid), generator=gen).to(dtype).to(DEVICE)
    lm_head[[500, 130, 7]] = lm_head[[0, 1, 2]]  # duplicates of early rows in later tiles
    ones = torch.ones(hid, dtype=dtype, device=DEVICE)
    h, last = signs().requires_grad_(), signs()  # a gradient to compute: the store strategy runs only then
    weights = torch.ones(n, device=DEVICE)
    out = lm_head_loss(h, ones, lm_head, weights, "kl", n, 0.0, last=last, final_norm_weight=ones, strategy=strategy)
    ref = eager.lm_head_loss(h, ones, lm_head, weights, "kl", n, 0.0, last=last, final_norm_weight=ones)
    logits = F.linear(h.detach().float(), lm_head.float())
    assert ((logits == logits.max(-1, keepdim=True).values).sum(-1) > 1).sum() >= 5, "the test needs tied rows"
    assert torch.equal(out.draft_argmax, ref.draft_argmax)
    assert torch.equal(out.teacher_argmax, ref.teacher_argmax)


def test_topk_mass_of_one_or_more_leaves_no_rest_term():
    inputs = make_inputs()
    inputs["topk_lse"] = inputs["topk_logits"].logsumexp(-1) - 1e-3  # sum p_i > 1: p_rest clamps to 0
    got = run(lm_head_loss, inputs, "kl_topk")
    assert_matches(got, run(eager.lm_head_loss, inputs, "kl_topk"), torch.float32)


def test_ce_with_stored_labels_never_reads_the_teacher():
    inputs = make_inputs()
    inputs["last"] = torch.full_like(inputs["last"], float("nan"))
    got = run(lm_head_loss, inputs, "ce", stored_labels=True)
    assert torch.equal(got[0].teacher_argmax, inputs["labels"])
    assert_matches(got, run(eager.lm_head_loss, inputs, "ce", stored_labels=True), torch.float32)


@pytest.mark.parametrize("kind,strategy", [("kl_topk", "recompute"), ("kl", "store")])
def test_frozen_lm_head_gets_no_gradient(kind, strategy):
    inputs = make_inputs(lm_head_grad=False)
    got = run(kernel_with(strategy), inputs, kind, stored_labels=False)
    assert got[1][2] is None
    assert_matches(got, run(eager.lm_head_loss, inputs, kind, stored_labels=False), torch.float32)


class LaunchLog:
    """Stands in for a Triton kernel of the module: logs each launch by name, then launches the kernel."""

    def __init__(self, kernel_fn, name, log):
        self.kernel_fn, self.name, self.log = kernel_fn, name, log

    def __getitem__(self, grid):
        self.log.append(self.name)
        return self.kernel_fn[grid]


@pytest.mark.parametrize(
    "strategy,env,expected",
    [
        (None, None, "recompute"),
        (None, "store", "store"),
        ("recompute", "store", "recompute"),
        ("store", None, "store"),
    ],
)
def test_strategy_argument_then_env_selects_the_kernels_that_run(monkeypatch, strategy, env, expected):
    launched = []
    for name in ("_vocab_stats_kernel", "_dlogits_kernel", "_store_logits_kernel", "_stored_dlogits_kernel"):
        monkeypatch.setattr(kernel, name, LaunchLog(getattr(kernel, name), name, launched))
    if env is None:
        monkeypatch.delenv("DFLASH_LM_HEAD_STRATEGY", raising=False)
    else:
        monkeypatch.setenv("DFLASH_LM_HEAD_STRATEGY", env)
    inputs = make_inputs()
    got = run(kernel_with(strategy), inputs, "kl", stored_labels=False)
    if expected == "store":
        chunks = triton.cdiv(37, kernel._store_rows(257, 4))
        assert chunks >= 3, "the test needs several row chunks"
        assert launched == ["_store_logits_kernel", "_stored_dlogits_kernel"] * chunks
    else:
        assert launched == ["_vocab_stats_kernel"] + ["_dlogits_kernel"] * triton.cdiv(257, kernel.VOCAB_CHUNK)
    assert_matches(got, run(eager.lm_head_loss, inputs, "kl", stored_labels=False), torch.float32)


@pytest.mark.parametrize(
    "strategy,env,source", [("stored", None, "the strategy argument"), (None, "cache", "DFLASH_LM_HEAD_STRATEGY")]
)
def test_unknown_strategy_names_the_value_and_the_choices(monkeypatch, strategy, env, source):
    if env is None:
        monkeypatch.delenv("DFLASH_LM_HEAD_STRATEGY", raising=False)
    else:
        monkeypatch.setenv("DFLASH_LM_HEAD_STRATEGY", env)
    with pytest.raises(
        ValueError, match=rf"'{strategy or env}' \(from {source}\) is not one of \('recompute', 'store'\)"
    ):
        run(kernel_with(strategy), make_inputs(n=4), "kl", stored_labels=False)


def test_gradients_scale_with_the_upstream_gradient():
    inputs = make_inputs()
    _, grads = run(lm_head_loss, inputs, "kl", stored_labels=False)
    h, nw, lm = inputs["h"], inputs["norm_weight"], inputs["lm_head_weight"]
    for p in (h, nw, lm):
        p.grad = None
    kwargs = dict(last=inputs["last"], final_norm_weight=inputs["final_norm_weight"])
    (-2.5 * lm_head_loss(h, nw, lm, inputs["weights"], "kl", 20.0, EPS, **kwargs).loss).backward()
    for g, p in zip(grads, (h, nw, lm)):
        torch.testing.assert_close(p.grad, -2.5 * g)


def test_no_grad_call_matches_and_keeps_no_graph():
    inputs = make_inputs()
    with torch.no_grad():
        out = lm_head_loss(
            inputs["h"],
            inputs["norm_weight"],
            inputs["lm_head_weight"],
            inputs["weights"],
            "ce",
            20.0,
            EPS,
            labels=inputs["labels"],
        )
    ref = run(eager.lm_head_loss, inputs, "ce")[0]
    assert not out.loss.requires_grad
    assert abs(out.loss.item() - ref.loss.item()) <= 1e-5 * max(1.0, abs(ref.loss.item()))


def test_tensor_normalizer_is_clamped_to_one():
    inputs = make_inputs(n=8)
    got = run(lm_head_loss, inputs, "ce_data", normalizer=torch.tensor(0.25, device=DEVICE))
    ref = run(eager.lm_head_loss, inputs, "ce_data", normalizer=torch.tensor(0.25, device=DEVICE))
    assert_matches(got, ref, torch.float32)


@pytest.mark.parametrize(
    "kind,drop,message",
    [
        ("ce_data", "labels", "needs labels"),
        ("kl", "last", "needs last"),
        ("kl_topk", "topk_lse", "needs topk_ids"),
        ("mse", None, "is not one of"),
    ],
)
def test_missing_inputs_raise_naming_the_input(kind, drop, message):
    inputs = make_inputs(n=4)
    if drop:
        inputs[drop] = None
    with pytest.raises(ValueError, match=message):
        run(lm_head_loss, inputs, kind)


def test_ops_switch_routes_to_the_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(kernel, "lm_head_loss", lambda *a, **k: calls.append(1) or lm_head_loss(*a, **k))
    inputs = make_inputs(n=8)
    try:
        ops.set_backend(lm_head_loss="triton")
        assert ops.backend_of("lm_head_loss") == "triton"
        got = run(ops.lm_head_loss, inputs, "kl", stored_labels=False)
    finally:
        ops.set_backend(lm_head_loss="auto")
    assert calls == [1]
    assert_matches(got, run(eager.lm_head_loss, inputs, "kl", stored_labels=False), torch.float32)


def test_bench_smoke_writes_results(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "bench/bench_lm_head_loss.py", "--smoke", "--out", str(tmp_path)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "lm_head_loss.json").read_text())["rows"]
    assert {r["impl"] for r in rows} >= {"eager", "triton-recompute", "triton-store"}
    assert {r["kind"] for r in rows if r["impl"] == "triton-store"} == {"kl"}
    assert {r["kind"] for r in rows} == {"kl", "ce (stored labels)"}
    assert all(r["ms"] is None or r["ms"] > 0 for r in rows)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,stored_labels,strategy", STRATEGY_CASES)
def test_bf16_is_closer_to_fp32_than_bf16_eager(monkeypatch, kind, stored_labels, strategy):
    monkeypatch.setattr(kernel, "STORE_CHUNK_BYTES", 0)  # the smallest chunks, 128 rows: 257 = 128 + 128 + 1
    inputs = make_inputs(n=257, hid=512, v=4099, k=8, dtype=torch.bfloat16, seed=4, w_scale=0.05)
    got = run(kernel_with(strategy), inputs, kind, stored_labels)
    bf16_eager = run(eager.lm_head_loss, inputs, kind, stored_labels)
    ref_inputs = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
    for name in ("h", "norm_weight", "lm_head_weight"):
        ref_inputs[name] = inputs[name].detach().float().requires_grad_()
    if kind == "ce" and not stored_labels:
        ref_inputs["labels"], stored_labels = got[0].teacher_argmax, True
    ref = run(eager.lm_head_loss, ref_inputs, kind, stored_labels)
    loss_err = abs(got[0].loss.item() - ref[0].loss.item()) / abs(ref[0].loss.item())
    assert loss_err < 1e-2, loss_err
    for g, e, r in zip(got[1], bf16_eager[1], ref[1]):
        err, eager_err = rel_err(g, r), rel_err(e, r)
        print(f"{kind} ({strategy}): kernel bf16 grad error {err:.2e}, eager bf16 {eager_err:.2e}")
        assert err <= GRAD_TOL[torch.bfloat16] and err <= 1.5 * eager_err + 1e-3
