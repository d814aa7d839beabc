"""Anchored attention, forward + backward: Triton kernel vs FlexAttention vs dense-mask SDPA.

    python bench/bench_attention.py [--out bench/results]  # GPU: Qwen3-8B drafter shapes, bf16
    python bench/bench_attention.py --smoke               # CPU: tiny fp32 shapes, Triton interpreter

GPU shapes: Hq=32, Hkv=8, D=128, B=16, A=512 sorted anchors, T=3072 and 8192, one
row of random documents. FlexAttention is compiled and its BlockMask is rebuilt by
a compiled `create_block_mask` every step, as peers train; it is reported with and
without that build (`step_ms` vs `fwd_bwd_ms`). The Triton kernel's host-side
plan (per-anchor context bounds) is inside its timed call. CPU times are no claim.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.attention_model import forward_visited_pairs, make_row, visible_pairs  # noqa: E402
from bench.harness import peak_memory_mb, time_ms, write_results  # noqa: E402

FLOP_NOTE = (
    "FLOPs of one forward+backward = 14 * D * Hq * R * pairs (forward 2 matmuls = 4*D per pair and head, "
    "backward 5 matmuls = 2.5x forward). tflops_visible counts pairs = visible (query, key) pairs; "
    "tflops_tiles counts pairs = BLOCK_M x BLOCK_N for every context tile the Triton forward visits (its autotuned "
    "tiles) plus BLOCK_P x BLOCK_P (16 x 16 for B <= 16) per pack of own blocks (bench/attention_model.py); "
    "pct_of_matmul = tflops_tiles / measured dense bf16 matmul rate (8192^3)."
)


def flex_mask_mod(anchors, anchor_valid, document_ids, block_size, window, causal):
    """spec.md §4 as a FlexAttention mask_mod over keys [context T ; block A*B]."""
    t = document_ids.shape[1]

    def mask_mod(b, _h, q_idx, kv_idx):
        i = q_idx // block_size
        a = anchors[b, i]
        ctx = (kv_idx < t) & (document_ids[b, torch.clamp(kv_idx, max=t - 1)] == document_ids[b, a]) & (kv_idx < a)
        if window is not None:
            ctx = ctx & (kv_idx >= a - window)
        slot = kv_idx - t
        blk = (kv_idx >= t) & (slot // block_size == i)
        if causal:
            blk = blk & (slot <= q_idx)
        return (ctx | blk) & anchor_valid[b, i]

    return mask_mod


def bench_shape(t, args, device, dtype, timing):
    from dflash_fast.kernels import anchored_attention as kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from dflash_fast.drafter.eager import anchored_attention_mask

    r, hq, hkv, d, b, a = 1, args.hq, args.hkv, args.head_dim, args.block_size, args.anchors
    n_q, window, causal = a * b, args.window, args.causal_in_block
    docs, anchors, valid = (x.to(device) for x in make_row(t, a))
    gen = torch.Generator(device="cpu").manual_seed(1)

    def rand(n, h):
        return torch.randn(r, n, h, d, generator=gen).to(device, dtype).requires_grad_()

    q, k_ctx, v_ctx, k_blk, v_blk = rand(n_q, hq), rand(t, hkv), rand(t, hkv), rand(n_q, hkv), rand(n_q, hkv)
    inputs = (q, k_ctx, v_ctx, k_blk, v_blk)
    grad_out = torch.randn(r, n_q, hq, d, generator=gen).to(device, dtype)

    def triton_fn():
        return kernel.anchored_attention(*inputs, anchors, valid, docs, b, window, causal)

    def as_heads_first(q, k_ctx, v_ctx, k_blk, v_blk, repeat):
        k = torch.cat([k_ctx, k_blk], 1).repeat_interleave(repeat, 2).transpose(1, 2)
        v = torch.cat([v_ctx, v_blk], 1).repeat_interleave(repeat, 2).transpose(1, 2)
        return q.transpose(1, 2), k, v

    mask_mod = flex_mask_mod(anchors, valid, docs, b, window, causal)
    compiled = device.type == "cuda"
    flex = torch.compile(flex_attention) if compiled else flex_attention

    def build_block_mask():
        return create_block_mask(mask_mod, r, None, n_q, t + n_q, device=device, _compile=compiled)

    block_mask = build_block_mask()

    def flex_fn():
        # FlexAttention has no CPU backward: there it sees detached inputs and runs forward only.
        qh, kh, vh = as_heads_first(*(inputs if compiled else [x.detach() for x in inputs]), repeat=1)
        return flex(qh, kh, vh, block_mask=block_mask, enable_gqa=True).transpose(1, 2)

    dense_mask = anchored_attention_mask(anchors, valid, docs, b, window, causal)[:, None]

    def sdpa_fn():
        # K/V repeated to Hq heads so the memory-efficient backend (which takes a mask) runs.
        qh, kh, vh = as_heads_first(*inputs, repeat=hq // hkv)
        return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=dense_mask).transpose(1, 2)

    reference = sdpa_fn().detach().float()
    plan = kernel.visibility_plan(anchors, valid, docs, window)
    pairs = visible_pairs(plan, b, causal)
    contenders = [
        ("triton", triton_fn, None, True),
        ("flex" if compiled else "flex (uncompiled, forward only on CPU)", flex_fn, build_block_mask, compiled),
        ("sdpa_dense_mask", sdpa_fn, lambda: anchored_attention_mask(anchors, valid, docs, b, window, causal), True),
    ]
    rows = []
    for name, fn, build, has_backward in contenders:

        def fwd_bwd(fn=fn):
            torch.autograd.grad(fn(), inputs, grad_out)

        diff = (fn().detach().float() - reference).abs().max().item()
        with torch.no_grad():
            fwd_ms = time_ms(fn, **timing)
        mask_ms = time_ms(build, **timing) if build is not None else 0.0
        row = dict(T=t, impl=name, mask_build_ms=mask_ms, fwd_ms=fwd_ms, max_abs_diff_vs_sdpa=diff)
        if has_backward:
            fwd_bwd_ms = time_ms(fwd_bwd, **timing)
            row.update(
                fwd_bwd_ms=fwd_bwd_ms,
                step_ms=mask_ms + fwd_bwd_ms,
                peak_mb=peak_memory_mb(fwd_bwd),
                tflops_visible=14 * d * hq * pairs / fwd_bwd_ms * 1e-9,
            )
        if name == "triton":
            cfg = kernel._attn_fwd_kernel.best_config.kwargs
            tiles = forward_visited_pairs(plan, b, cfg["BLOCK_M"], cfg["BLOCK_N"])
            row.update(tflops_tiles=14 * d * hq * tiles / fwd_bwd_ms * 1e-9, tiles=f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}")
        rows.append(row)
    flex_row = rows[1]
    for row in rows:
        if "step_ms" in row and "step_ms" in flex_row:
            row["speedup_step_vs_flex"] = flex_row["step_ms"] / row["step_ms"]
            row["speedup_fwd_bwd_vs_flex"] = flex_row["fwd_bwd_ms"] / row["fwd_bwd_ms"]
    return rows


def matmul_tflops(device, timing):
    n = 8192
    x = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    y = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n**3 / time_ms(lambda: x @ y, **timing) * 1e-9


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny fp32 shapes that run on CPU (Triton interpreter)")
    parser.add_argument(
        "--out", default=os.path.join("bench", "results"), help="directory for bench_attention.{json,md,png}"
    )
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[3072, 8192], help="context tokens T per row")
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--hq", type=int, default=32)
    parser.add_argument("--hkv", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--window", type=int, default=None, help="sliding-window width W (default: full context)")
    parser.add_argument("--causal-in-block", action="store_true")
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    if args.smoke:
        args.seq_lens, args.anchors, args.block_size, args.hq, args.hkv, args.head_dim = [64], 8, 4, 4, 2, 16
        if not on_gpu:
            # Must precede the first import of a @triton.jit module.
            os.environ["TRITON_INTERPRET"] = "1"
    elif not on_gpu:
        parser.error("the full benchmark needs a CUDA GPU; use --smoke on CPU")
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    timing = dict(warmup=3, rep=10) if on_gpu else dict(warmup=0, rep=1)
    rows = [row for t in args.seq_lens for row in bench_shape(t, args, device, dtype, timing)]
    notes = [FLOP_NOTE]
    if on_gpu:
        peak = matmul_tflops(device, timing)
        notes.append(f"measured dense bf16 matmul: {peak:.0f} TFLOP/s")
        for row in rows:
            if "tflops_tiles" in row:
                row["pct_of_matmul"] = 100 * row["tflops_tiles"] / peak
    else:
        notes.append(
            "CPU smoke run: FlexAttention runs uncompiled and forward only (it has no CPU backward); "
            "times are no claim."
        )
    md = write_results("bench_attention", rows, args.out, plot={"x": "T", "y": "step_ms", "group": "impl"})
    with open(os.path.join(args.out, "bench_attention.md"), "a") as f:
        f.write("\n" + "".join(f"- {n}\n" for n in notes))
    print(md + "\n" + "\n".join(notes))


if __name__ == "__main__":
    main()
