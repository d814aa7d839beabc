"""The anchored-attention Triton kernel against its eager twin (spec.md §4).

On CPU the kernel runs under TRITON_INTERPRET=1 with 32x32 tiles, so the shapes
below span several query and key tiles and end mid-tile. A tile packs whole blocks
into 16-row packs (B = 3: five blocks and a padding row; B = 4: four; B = 16: one; B = 20: one block
in a 32-row pack).
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from dflash_fast.kernels.anchored_attention import anchored_attention

from dflash_fast.drafter import eager, ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Row 0: documents [0, 47) [47, 52) [52, 101); anchors at document starts (no
# context), last tokens of documents, and one invalid anchor in the middle.
# Row 1: documents [0, 70) [70, 101); eight late anchors in the first document
# (a query tile whose rows all see a whole context tile), then a padding slot.
T = 101
DOC_LENGTHS = ([47, 5, 49], [70, 31])
ANCHORS = ([0, 1, 33, 40, 46, 47, 51, 53, 100], [35, 40, 45, 50, 55, 60, 65, 69, 0])
VALID = ([1, 1, 1, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1, 0])
TOL = {torch.float32: dict(atol=2e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-2)}
BF16_REL_ERR = 2e-2  # ||kernel - eager|| / ||eager||: P is rounded to bf16 (8 mantissa bits) before P @ V


def assert_close(actual, expected, name):
    if actual.dtype == torch.bfloat16:
        rel = ((actual.float() - expected.float()).norm() / expected.float().norm().clamp(min=1e-12)).item()
        assert rel < BF16_REL_ERR, f"{name}: relative error {rel:.3g} >= {BF16_REL_ERR}"
    else:
        torch.testing.assert_close(actual, expected, **TOL[actual.dtype], msg=lambda m: f"{name}: {m}")


def make_inputs(block_size, hq, hkv, d, dtype, seed=0, doc_lengths=DOC_LENGTHS, anchors=ANCHORS, valid=VALID, t=T):
    """The two-row batch above with random q/k/v -> (q, k_ctx, v_ctx, k_blk, v_blk), anchors, anchor_valid,
    document_ids."""
    gen = torch.Generator().manual_seed(seed)
    r, a = len(anchors), len(anchors[0])
    n_q = a * block_size
    document_ids = torch.stack([torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls)) for ls in doc_lengths])
    assert document_ids.shape == (r, t)

    def rand(n, h):
        return torch.randn(r, n, h, d, generator=gen).to(DEVICE, dtype).requires_grad_()

    tensors = (rand(n_q, hq), rand(t, hkv), rand(t, hkv), rand(n_q, hkv), rand(n_q, hkv))
    return (
        tensors,
        torch.tensor(anchors, device=DEVICE),
        torch.tensor(valid, dtype=torch.bool, device=DEVICE),
        document_ids.to(DEVICE),
    )


def output_and_grads(fn, tensors, *args, **kwargs):
    out = fn(*tensors, *args, **kwargs)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    return out, torch.autograd.grad(out, tensors, grad_out)


def assert_matches_eager(block_size, hq, hkv, d, dtype, window, causal, window_from="anchor", **case):
    tensors, anchors, valid, docs = make_inputs(block_size, hq, hkv, d, dtype, **case)
    args = (anchors, valid, docs, block_size, window, causal)
    out, grads = output_and_grads(anchored_attention, tensors, *args, window_from=window_from)
    ref, ref_grads = output_and_grads(eager.anchored_attention, tensors, *args, window_from=window_from)
    assert_close(out, ref, "out")
    for name, g, g_ref in zip(("dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk"), grads, ref_grads):
        assert_close(g, g_ref, name)


@pytest.mark.parametrize(
    "block_size, hq, hkv, d, dtype, window, causal",
    [
        (4, 4, 1, 16, torch.float32, None, False),
        (16, 2, 2, 32, torch.float32, 9, True),
        (4, 4, 1, 16, torch.float16, 20, True),
        (16, 2, 2, 64, torch.float16, None, False),
        (3, 4, 4, 16, torch.float32, 40, False),
        (16, 4, 2, 128, torch.float16, None, True),
        (20, 2, 1, 16, torch.float32, 30, True),
    ],
    ids=[
        "B4-gqa4-fp32",
        "B16-gqa1-window-causal-fp32",
        "B4-gqa4-window-causal-fp16",
        "B16-D64-fp16",
        "B3-window-fp32",
        "B16-D128-gqa2-causal-fp16",
        "B20-pack32-gqa2-window-causal-fp32",
    ],
)
def test_output_and_all_gradients_match_eager(block_size, hq, hkv, d, dtype, window, causal):
    assert_matches_eager(block_size, hq, hkv, d, dtype, window, causal)


def test_tiles_at_interval_edges_match_eager():
    """Context tiles a whole query/key tile sees skip the mask; one key off at either edge must not.

    Row 0: one document, the first anchor at 63, one key before the 32-key tile boundary.
    Row 1: a document starting at 33, one key past a tile boundary, anchors from 96 on.
    B = 3 does not divide the 32-row tiles, so tiles also start and end mid-block.
    """
    gen = torch.Generator().manual_seed(5)
    a = 32
    anchors = (
        [63] + sorted(torch.randperm(135, generator=gen)[: a - 1].add(64).tolist()),
        sorted(torch.randperm(104, generator=gen)[:a].add(96).tolist()),
    )
    assert_matches_eager(
        3,
        4,
        2,
        16,
        torch.float32,
        None,
        True,
        doc_lengths=([200], [33, 167]),
        anchors=anchors,
        valid=([1] * a, [1] * a),
        t=200,
    )


@pytest.mark.parametrize(
    "block_size, hq, hkv, d, window, causal",
    [(3, 4, 2, 16, 7, False), (5, 2, 1, 16, 40, True), (16, 2, 2, 32, 19, False)],
    ids=["B3-window7-gqa2", "B5-window40-causal", "B16-window19"],
)
def test_per_query_window_output_and_all_gradients_match_eager(block_size, hq, hkv, d, window, causal):
    """window_from="query" (each slot's window ends at its own position): fp32, odd blocks and windows that end
    inside key tiles, forward and every gradient."""
    assert_matches_eager(block_size, hq, hkv, d, torch.float32, window, causal, window_from="query")


def test_per_query_window_masks_a_key_tile_that_slot_0_sees_whole():
    """Anchors 64..71 (B = 4: one 32-row anchor tile, window 40): slot 0 of every anchor sees the key tile
    [32, 64) whole (its first key, a - 39, is 25..32), so a tile skip that trusted slot 0's bounds would leave the
    tile unmasked for the last slots (anchor 71's slot 3 starts at 35). Row 1 shifts every anchor by one key."""
    anchors = (list(range(64, 72)), list(range(65, 73)))
    assert_matches_eager(4, 2, 1, 16, torch.float32, 40, True, "query", doc_lengths=([101], [101]), anchors=anchors,
                         valid=([1] * 8, [1] * 8))


def test_per_query_window_needs_a_window_that_holds_the_block():
    tensors, anchors, valid, docs = make_inputs(4, 2, 1, 16, torch.float32)
    for fn in (anchored_attention, eager.anchored_attention):
        with pytest.raises(ValueError, match="window 3 < block_size 4"):
            fn(*tensors, anchors, valid, docs, 4, 3, window_from="query")


def test_context_is_strictly_before_anchor():
    block_size, i = 4, 2  # anchor 33 in row 0, document [0, 47)
    (q, k_ctx, v_ctx, k_blk, v_blk), anchors, valid, docs = make_inputs(block_size, 2, 1, 16, torch.float32)
    a = int(anchors[0, i])
    rows = slice(i * block_size, (i + 1) * block_size)

    def block_output(pos):
        kc, vc = k_ctx.detach().clone(), v_ctx.detach().clone()
        if pos is not None:
            kc[0, pos] += 3.0
            vc[0, pos] += 3.0
        return anchored_attention(q.detach(), kc, vc, k_blk.detach(), v_blk.detach(), anchors, valid, docs, block_size)[
            0, rows
        ]

    base = block_output(None)
    torch.testing.assert_close(block_output(a), base, atol=0, rtol=0)
    assert (block_output(a - 1) - base).abs().max() > 1e-2


def test_invalid_anchors_give_zero_output_and_no_gradient():
    block_size = 4
    tensors, anchors, valid, docs = make_inputs(block_size, 4, 2, 16, torch.float32)
    out, (dq, _, _, dk_blk, dv_blk) = output_and_grads(anchored_attention, tensors, anchors, valid, docs, block_size)
    invalid_rows = (~valid).repeat_interleave(block_size, dim=1)
    assert invalid_rows.sum() == 2 * block_size
    for name, x in (("out", out), ("dq", dq), ("dk_blk", dk_blk), ("dv_blk", dv_blk)):
        assert torch.all(x[invalid_rows] == 0), name
        assert x[~invalid_rows].abs().sum() > 0, name


def test_unsorted_anchors_stay_correct():
    """Sortedness only makes the kernel fast; a shuffled row must give the eager result."""
    anchors = ([46, 0, 100, 33, 47, 1, 53, 51, 40], [69, 35, 60, 45, 50, 0, 65, 55, 40])
    valid = ([1, 1, 1, 1, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 1, 1, 1])
    assert_matches_eager(4, 2, 1, 16, torch.float32, None, False, anchors=anchors, valid=valid)


def test_rejects_head_dim_that_is_not_a_power_of_two():
    tensors, anchors, valid, docs = make_inputs(4, 2, 1, 24, torch.float32)
    with pytest.raises(ValueError, match="head dim 24"):
        anchored_attention(*tensors, anchors, valid, docs, 4)


def test_triton_backend_routes_ops_to_the_kernel():
    tensors, anchors, valid, docs = make_inputs(4, 2, 1, 16, torch.float32)
    try:
        ops.set_backend(anchored_attention="triton")
        out = ops.anchored_attention(*tensors, anchors, valid, docs, 4)
    finally:
        ops.set_backend(anchored_attention="auto")
    assert "AnchoredAttention" in type(out.grad_fn).__name__
    assert_close(out, eager.anchored_attention(*tensors, anchors, valid, docs, 4), "out")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_bf16_matches_eager_at_drafter_head_dim(causal):
    gen = torch.Generator().manual_seed(3)
    t, a = 640, 24
    doc_lengths = ([300, 200, 140], [640])
    anchors = [sorted(torch.randperm(t - 1, generator=gen)[:a].tolist()) for _ in range(2)]
    valid = [[1] * (a - 3) + [0] * 3, [1] * a]
    assert_matches_eager(
        16,
        8,
        2,
        128,
        torch.bfloat16,
        256 if causal else None,
        causal,
        doc_lengths=doc_lengths,
        anchors=anchors,
        valid=valid,
        t=t,
    )


def test_bench_smoke_writes_results(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "bench_attention.py"), "--smoke", "--out", str(tmp_path)],
        check=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    rows = json.loads((tmp_path / "bench_attention.json").read_text())["rows"]
    assert any(r["impl"] == "triton" and r["fwd_bwd_ms"] > 0 for r in rows)
