"""bench/attention_model.py walks the tiles each attention program visits; it must walk the kernel's.

Under TRITON_INTERPRET=1 the kernels' @triton.jit helpers are called as Python, once per visited
context tile (`_context_scores`, in the forward and in dQ) or per dK/dV iteration, so counting those
calls counts the kernel's work.
"""

import os
import sys

import torch
from dflash_fast.kernels import anchored_attention as kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import attention_model  # noqa: E402

B, HQ, HKV, D, T = 4, 4, 2, 16, 150


def counting(monkeypatch, name):
    calls = []
    original = getattr(kernel, name)
    monkeypatch.setattr(kernel, name, lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    return calls


def test_model_walks_the_tiles_the_kernels_visit(monkeypatch):
    rows = [attention_model.make_row(T, 24, seed=s, doc_lengths=lengths) for s, lengths in ((0, [T]), (1, None))]
    docs, anchors, valid = (torch.cat(x) for x in zip(*rows))
    valid[1, 5] = False
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 24 * B, HQ, D, generator=gen, requires_grad=True)
    kv = [torch.randn(2, n, HKV, D, generator=gen, requires_grad=True) for n in (T, T, 24 * B, 24 * B)]
    scores_calls, rows_calls = (counting(monkeypatch, n) for n in ("_context_scores", "_tile_rows"))
    out = kernel.anchored_attention(q, *kv, anchors, valid, docs, B)
    fwd, forward_rows_calls = len(scores_calls), len(rows_calls)
    out.backward(torch.ones_like(out))
    dq = len(scores_calls) - fwd  # of the backward passes only dQ walks the context tiles

    config = kernel._attn_fwd_kernel.configs[0].kwargs
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    plan = kernel.visibility_plan(anchors, valid, docs, None)
    ranges = kernel.context_ranges(plan, T, B)
    tiles = [attention_model.tiles_after(plan, 24, B, block_m, block_n, r) for r in range(2)]
    assert fwd == HQ * sum(map(sum, tiles)) > 0
    assert dq == fwd
    key_config = kernel._attn_bwd_dkdv_kernel.configs[0].kwargs
    iterations = [
        attention_model.key_tile_iterations(
            ranges, T, 24, B, HQ // HKV, key_config["BLOCK_M"], key_config["BLOCK_N"], packed=True, r=r
        )
        for r in range(2)
    ]
    programs = 2 * HQ * len(tiles[0])  # of the forward (2 rows x Hq x anchor tiles): one _tile_rows call each
    assert forward_rows_calls == programs
    # The backward: one call per dQ program and one per dK/dV iteration.
    assert len(rows_calls) - 2 * programs == HKV * sum(map(sum, iterations)) > 0
