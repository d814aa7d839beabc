"""The fused norm + lm_head + loss kernel equals its eager twin (dflash_fast.drafter.eager.lm_head_loss).

CPU runs go through the Triton interpreter (tests/conftest.py) in fp32 and fp16 with
small H and V; bf16 numerics are checked on a GPU against an fp32 eager reference.
Under the interpreter the kernel processes 16-row chunks, so N = 37 is 16 + 16 + 5, and
teacher rows shared by several drafter rows (Teacher.index) are computed once per chunk.
"""
import inspect
import json
import os
import subprocess
import sys

import dflash_fast.kernels.lm_head_loss as kernel
import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from dflash_fast.kernels.lm_head_loss import lm_head_loss

from dflash_fast.drafter import eager, ops
from dflash_fast.drafter.losses import DPace, Teacher

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.lm_head_model import tile_order  # noqa: E402

EPS = 1e-6
# Max |kernel - eager| relative to max |eager|, per dtype: fp16 eager rounds logits and
# dlogits to fp16, the kernel keeps logits in fp32.
GRAD_TOL = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}
LOSS_TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (kind, stored labels?) -- every path through the kernel.
KIND_CASES = [("kl", False), ("ce", False), ("ce", True), ("ce_data", True), ("kl_topk", False)] + [
    (kind, False) for kind in ("tv", "lk", "lk_hybrid", "rkl", "jsd")  # the other dense kinds: two row passes
]


def make_inputs(n=37, hid=64, v=257, k=5, dtype=torch.float32, seed=0, w_scale=0.3, lm_head_grad=True, positions=None):
    """Loss inputs; positions: None (one teacher row per drafter row) or U, for `last` [U, H] and
    index [N] into it, every row of `last` used by several drafter rows (overlapping blocks)."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)
    weights = torch.rand(n, generator=gen) + 0.5
    weights[::4] = 0  # masked slots
    teacher_logits = 2 * rand(n, v)
    top = teacher_logits.topk(k, dim=-1)
    to = lambda x: x.to(DEVICE)
    index = None if positions is None else to(torch.randint(0, positions, (n,), generator=gen))
    return dict(
        h=to(rand(n, hid).to(dtype)).requires_grad_(),
        norm_weight=to((1 + 0.1 * rand(hid)).to(dtype)).requires_grad_(),
        lm_head_weight=to((w_scale * rand(v, hid)).to(dtype)).requires_grad_(lm_head_grad),
        weights=to(weights),
        last=to(rand(n if positions is None else positions, hid).to(dtype)),
        final_norm_weight=to((1 + 0.1 * rand(hid)).to(dtype)),
        index=index,
        labels=to(torch.randint(0, v, (n,), generator=gen)),
        topk_ids=to(top.indices),
        topk_logits=to(top.values),
        topk_lse=to(teacher_logits.logsumexp(-1)),
    )


def teacher_of(inputs, stored_labels=True):
    names = ("last", "final_norm_weight", "index", "labels", "topk_ids", "topk_logits", "topk_lse")
    teacher = Teacher(**{name: inputs[name] for name in names})
    return teacher if stored_labels else teacher._replace(labels=None)


def run(fn, inputs, kind, stored_labels=True, normalizer=20.0, dpace=None):
    """Loss output and the gradients of (h, norm_weight, lm_head_weight) for one call."""
    params = [inputs["h"], inputs["norm_weight"], inputs["lm_head_weight"]]
    for p in params:
        p.grad = None
    teacher = teacher_of(inputs, stored_labels)
    out = fn(params[0], params[1], params[2], inputs["weights"], kind, normalizer, EPS, teacher, dpace)
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
    if ref_out.kl is not None:  # relative to the KL itself: a TV loss is <= 1 while its KL metric is not
        kl_tol = LOSS_TOL[dtype] * max(1.0, abs(ref_out.kl.item()))
        assert abs(out.kl.item() - ref_out.kl.item()) <= kl_tol, (out.kl.item(), ref_out.kl.item())
    assert out.alpha.dtype == torch.float32 and out.alpha.shape == ref_out.alpha.shape
    assert (out.alpha - ref_out.alpha).abs().max().item() <= LOSS_TOL[dtype], "alpha"
    if check_argmax:
        assert torch.equal(out.draft_argmax, ref_out.draft_argmax)
        assert torch.equal(out.teacher_argmax, ref_out.teacher_argmax)
    for name, g, r in zip(("dh", "dnorm", "dlm_head"), grads, ref_grads):
        assert (g is None) == (r is None), name
        if r is not None:
            assert g.dtype == r.dtype and g.shape == r.shape, name
            assert rel_err(g, r) <= grad_tol, (name, rel_err(g, r))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind,stored_labels", KIND_CASES)
def test_loss_metrics_argmax_and_grads_match_eager(kind, stored_labels, dtype):
    inputs = make_inputs(dtype=dtype)
    got = run(lm_head_loss, inputs, kind, stored_labels)
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


@pytest.mark.parametrize("kind,stored_labels", [("kl", False), ("kl_topk", False), ("ce", True), ("ce", False)])
def test_vocab_not_a_multiple_of_the_tile_nor_the_chunk(kind, stored_labels):
    inputs = make_inputs(n=70, hid=48, v=601, k=3, seed=1)  # 4 chunks of 16 rows and one of 6
    got = run(lm_head_loss, inputs, kind, stored_labels)
    assert_matches(got, run(eager.lm_head_loss, inputs, kind, stored_labels), torch.float32)


def test_zero_weight_rows_get_no_gradient():
    inputs = make_inputs()
    (_, (dh, _, _)) = run(lm_head_loss, inputs, "kl", stored_labels=False)
    masked = inputs["weights"] == 0
    assert masked.any() and (dh[masked] == 0).all() and (dh[~masked] != 0).any(dim=-1).all()


@pytest.mark.parametrize("kind,stored_labels", KIND_CASES)
def test_all_masked_input_gives_zero_loss_and_zero_grads(kind, stored_labels):
    inputs = make_inputs()
    inputs["weights"] = torch.zeros_like(inputs["weights"])
    out, grads = run(lm_head_loss, inputs, kind, stored_labels, normalizer=0.0)
    assert out.loss.item() == 0.0
    assert out.kl is None or out.kl.item() == 0.0
    assert all(torch.count_nonzero(g) == 0 for g in grads)


@pytest.mark.parametrize("kind,stored_labels", KIND_CASES)
def test_extreme_logits_do_not_overflow(kind, stored_labels):
    # |logits| in the thousands: exp() of any unshifted logit overflows fp32.
    inputs = make_inputs(w_scale=300.0, seed=2)
    with torch.no_grad():
        inputs["h"].mul_(1e4)
        inputs["last"].mul_(1e4)
        inputs["topk_logits"].mul_(1e3)
        inputs["topk_lse"].copy_(inputs["topk_logits"][:, 0] + 1e-3)
    got = run(lm_head_loss, inputs, kind, stored_labels)
    assert torch.isfinite(got[0].loss) and all(torch.isfinite(g).all() for g in got[1])
    # fp32 rounding of logits in the thousands (~3e-4) moves the unsaturated softmax entries
    # in eager and kernel alike: the gradients agree to that conditioning, not to 2e-5.
    ref = run(eager.lm_head_loss, inputs, kind, stored_labels)
    if kind == "jsd":  # saturated at log 2 on every row: both gradients are rounding noise (~1e-6 against ~1e2)
        assert all(g.abs().max() < 1e-5 and r.abs().max() < 1e-5 for g, r in zip(got[1], ref[1]))
        got, ref = (got[0], [None] * 3), (ref[0], [None] * 3)
    assert_matches(got, ref, torch.float32, grad_tol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_argmax_ties_resolve_to_smallest_index(dtype):
    # h = +-1 with eps = 0 and a unit norm weight normalise exactly; integer lm_head rows make
    # integer logits, so maxima tie exactly, within a tile and across tiles and merge blocks.
    gen = torch.Generator().manual_seed(3)
    n, hid, v = 37, 16, 601
    signs = lambda: (torch.randint(0, 2, (n, hid), generator=gen) * 2 - 1).to(dtype).to(DEVICE)
    lm_head = torch.randint(-1, 2, (v, hid), generator=gen).to(dtype).to(DEVICE)
    lm_head[[500, 130, 7]] = lm_head[[0, 1, 2]]  # duplicates of early rows in later tiles
    ones = torch.ones(hid, dtype=dtype, device=DEVICE)
    h, last = signs().requires_grad_(), signs()
    weights = torch.ones(n, device=DEVICE)
    teacher = Teacher(last=last, final_norm_weight=ones)
    out = lm_head_loss(h, ones, lm_head, weights, "kl", n, 0.0, teacher)
    ref = eager.lm_head_loss(h, ones, lm_head, weights, "kl", n, 0.0, teacher)
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


@pytest.mark.parametrize("kind", ["kl_topk", "kl"])
def test_frozen_lm_head_gets_no_gradient(kind):
    inputs = make_inputs(lm_head_grad=False)
    got = run(lm_head_loss, inputs, kind, stored_labels=False)
    assert got[1][2] is None
    assert_matches(got, run(eager.lm_head_loss, inputs, kind, stored_labels=False), torch.float32)


class LaunchLog:
    """Stands in for a Triton kernel of the module: logs each launch's rows (its first argument), then launches."""

    def __init__(self, kernel_fn, log):
        self.kernel_fn, self.log = kernel_fn, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(args[0].shape[0])
            return self.kernel_fn[grid](*args, **kwargs)

        return launch


def overlapping_blocks(block=4, blocks=12, doc_len=12, seed=5):
    """Drafter rows of `blocks` blocks whose anchors crowd a short document (heavy position overlap),
    scored against the teacher at p - 1: index [N] into `doc_len` positions, weights [N] with slot 0
    and the slots past the document masked (their teacher positions are used by masked rows only)."""
    gen = torch.Generator().manual_seed(seed)
    anchors = torch.randint(1, doc_len - 2, (blocks,), generator=gen).sort().values
    position = anchors[:, None] + torch.arange(block)
    weights = ((torch.arange(block) > 0) & (position < doc_len - 1)).float() * (1 + torch.rand(blocks, block))
    return (position - 1).clamp(max=doc_len - 1).flatten(), weights.flatten()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", ["kl", "ce"])
def test_teacher_once_per_position_equals_teacher_per_slot(monkeypatch, kind, dtype):
    index, weights = overlapping_blocks()
    n, positions = index.numel(), 12
    inputs = make_inputs(n=n, dtype=dtype, positions=positions, seed=6)
    inputs["index"], inputs["weights"] = index.to(DEVICE), weights.to(DEVICE)
    rows = []
    monkeypatch.setattr(kernel, "_logits_fwd_kernel", LaunchLog(kernel._logits_fwd_kernel, rows))
    got = run(lm_head_loss, inputs, kind, stored_labels=False)
    chunk = kernel.chunk_rows(n, 257, inputs["h"].element_size(), kind == "kl")
    distinct = [index[lo : lo + chunk].unique().numel() for lo in range(0, n, chunk)]
    assert len(distinct) >= 2 and sum(distinct) < n, "the test needs chunks whose rows share teacher positions"
    assert rows == [min(chunk, n - lo) + u for lo, u in zip(range(0, n, chunk), distinct)]
    per_slot = dict(inputs, last=inputs["last"][inputs["index"]], index=None)  # today's layout: one row per slot
    assert_matches(got, run(lm_head_loss, per_slot, kind, stored_labels=False), dtype)
    if dtype == torch.float32:
        assert_matches(got, run(eager.lm_head_loss, inputs, kind, stored_labels=False), dtype)


@pytest.mark.parametrize(
    "kind,stored_labels,dtype",
    [(kind, labels, torch.float32) for kind, labels in KIND_CASES] + [("kl", False, torch.float16)],
)
def test_dpace_loss_and_grads_match_eager(kind, stored_labels, dtype):
    # 11 blocks of 4: 16-row chunks hold whole blocks, 16 + 16 + 12; slot 0 of every block is masked.
    inputs = make_inputs(n=44, dtype=dtype, seed=7, w_scale=1.0)
    dpace = DPace(0.3, 4)
    got = run(lm_head_loss, inputs, kind, stored_labels, dpace=dpace)
    if kind == "ce" and not stored_labels:  # fp32 logits decide the argmax, as in the test above
        inputs["labels"], stored_labels = got[0].teacher_argmax, True
    ref = run(eager.lm_head_loss, inputs, kind, stored_labels, dpace=dpace)
    assert_matches(got, ref, dtype, check_argmax=dtype == torch.float32)
    plain = run(eager.lm_head_loss, inputs, kind, stored_labels)
    assert abs(plain[0].loss.item() - ref[0].loss.item()) > 1e-2, "D-PACE must change the loss"


def test_chunk_plan_lists_each_chunks_distinct_teacher_rows():
    index = torch.tensor([3, 3, 1, 4, 4, 4, 0, 3, 9, 9])
    plan = kernel.chunk_plan(10, 4, index, num_teacher=10)
    assert [(c.lo, c.hi) for c in plan] == [(0, 4), (4, 8), (8, 10)]
    for c in plan:
        assert torch.equal(c.teacher_rows, index[c.lo : c.hi].unique())
        assert torch.equal(c.teacher_rows[c.teacher_of], index[c.lo : c.hi])


@pytest.mark.parametrize("n_m,n_n,group", [(5, 7, 2), (3, 4, 3), (11, 6, 1), (4, 9, 64)])
def test_tile_order_visits_every_tile_once_in_groups(n_m, n_n, group):
    """The kernels' grouped tile order (`_tile_order`), run under the interpreter, against the design
    model's copy of it (bench/lm_head_model.py), which prices the HBM reuse of each order."""

    @triton.jit
    def order_kernel(out_ptr, n_m, n_n, group):
        pid = tl.program_id(0)
        i_m, i_n = kernel._tile_order(pid, n_m, n_n, group)
        tl.store(out_ptr + 2 * pid, i_m)
        tl.store(out_ptr + 2 * pid + 1, i_n)

    out = torch.empty(n_m * n_n, 2, dtype=torch.int32, device=DEVICE)
    order_kernel[(n_m * n_n,)](out, n_m, n_n, group)
    got = [tuple(t) for t in out.tolist()]
    assert sorted(got) == [(i, j) for i in range(n_m) for j in range(n_n)]
    assert got == [tile_order(pid, n_m, n_n, group) for pid in range(n_m * n_n)]
    if group == 1:
        assert got[:n_n] == [(0, j) for j in range(n_n)], "group 1: every column tile of row tile 0 first"
    if group >= n_m:
        assert got[:n_m] == [(i, 0) for i in range(n_m)], "one group: every row tile of column tile 0 first"


def test_gradients_scale_with_the_upstream_gradient():
    inputs = make_inputs()
    _, grads = run(lm_head_loss, inputs, "kl", stored_labels=False)
    h, nw, lm = inputs["h"], inputs["norm_weight"], inputs["lm_head_weight"]
    for p in (h, nw, lm):
        p.grad = None
    teacher = teacher_of(inputs, stored_labels=False)
    (-2.5 * lm_head_loss(h, nw, lm, inputs["weights"], "kl", 20.0, EPS, teacher).loss).backward()
    for g, p in zip(grads, (h, nw, lm)):
        torch.testing.assert_close(p.grad, -2.5 * g)


@pytest.mark.parametrize("kind,stored_labels", [("ce", True), ("kl", False), ("kl_topk", False)])
def test_no_grad_call_matches_and_keeps_no_graph(kind, stored_labels):
    inputs = make_inputs()
    args = (inputs["h"], inputs["norm_weight"], inputs["lm_head_weight"], inputs["weights"], kind, 20.0, EPS)
    with torch.no_grad():
        out = lm_head_loss(*args, teacher_of(inputs, stored_labels))
    ref = run(eager.lm_head_loss, inputs, kind, stored_labels)[0]
    assert not out.loss.requires_grad
    assert abs(out.loss.item() - ref.loss.item()) <= 1e-5 * max(1.0, abs(ref.loss.item()))
    assert out.kl is None or abs(out.kl.item() - ref.kl.item()) <= 1e-5 * max(1.0, abs(ref.kl.item()))


def test_tensor_normalizer_is_clamped_to_one():
    inputs = make_inputs(n=8)
    got = run(lm_head_loss, inputs, "ce_data", normalizer=torch.tensor(0.25, device=DEVICE))
    ref = run(eager.lm_head_loss, inputs, "ce_data", normalizer=torch.tensor(0.25, device=DEVICE))
    assert_matches(got, ref, torch.float32)


@pytest.mark.parametrize(
    "kind,drop,message",
    [
        ("ce_data", "labels", "needs teacher.labels"),
        ("kl", "last", "needs teacher.last"),
        ("kl_topk", "topk_lse", "needs teacher.topk_ids"),
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


def test_eager_twin_has_the_kernels_exact_signature():
    # dflash_fast/drafter/eager.py promises it, and ops.lm_head_loss passes the same arguments to either backend.
    assert inspect.signature(eager.lm_head_loss) == inspect.signature(lm_head_loss)


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
    assert {r["impl"] for r in rows} >= {"eager", "triton"}
    assert {r["kind"] for r in rows if r["impl"] == "triton"} == {"kl", "ce (stored labels)"}
    assert all(r["ms"] is None or r["ms"] > 0 for r in rows)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,stored_labels", KIND_CASES)
def test_bf16_is_closer_to_fp32_than_bf16_eager(monkeypatch, kind, stored_labels):
    monkeypatch.setattr(kernel, "CHUNK_BYTES", 0)  # the smallest chunks, 128 rows: 257 = 128 + 128 + 1
    inputs = make_inputs(n=257, hid=512, v=4099, k=8, dtype=torch.bfloat16, seed=4, w_scale=0.05, positions=97)
    got = run(lm_head_loss, inputs, kind, stored_labels)
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
        print(f"{kind}: kernel bf16 grad error {err:.2e}, eager bf16 {eager_err:.2e}")
        assert err <= GRAD_TOL[torch.bfloat16] and err <= 1.5 * eager_err + 1e-3
