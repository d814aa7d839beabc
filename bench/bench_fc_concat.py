"""fc-concat forward+backward: Triton kernel vs eager (stack + Linear + RMSNorm) vs torch.compile(eager).

    python bench/bench_fc_concat.py                 # GPU: N = 3072, 8192; K = 5; H = H_t = 4096; bf16
    python bench/bench_fc_concat.py --smoke         # CPU, Triton interpreter, tiny fp32 shapes (CI only)

Layouts: `tensor` is one contiguous [N, K, H_t] tensor (eager reshapes it without a copy), `list` is
K separate [N, H_t] tensors (eager stacks them). Writes <out>/fc_concat.json and .md
(fc_concat_smoke.* with --smoke). Ratios are eager (or compiled) time / this row's time, so > 1
means this row is faster.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EPS = 1e-6
NOISE_STD = 0.05


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny fp32 shapes on CPU through the Triton interpreter")
    p.add_argument("--out", default=os.path.join("bench", "results"), help="results folder (default bench/results)")
    p.add_argument("--n", type=int, nargs="+", default=[3072, 8192], help="token counts N (GPU run)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel module is imported, below
    import torch
    from dflash_fast.kernels.fc_concat import fc_concat

    from bench.harness import peak_memory_mb, time_ms, write_results
    from dflash_fast.drafter import eager

    if args.smoke:
        device, dtype, shapes, reps = "cpu", torch.float32, [(32, 2, 32, 24)], dict(warmup=0, rep=1)
        impls = {"eager": eager.fc_concat, "triton": fc_concat}
    else:
        if not torch.cuda.is_available():
            sys.exit("the full benchmark needs a CUDA GPU; run with --smoke on CPU")
        device, dtype, shapes, reps = "cuda", torch.bfloat16, [(n, 5, 4096, 4096) for n in args.n], {}
        impls = {"eager": eager.fc_concat, "compiled": torch.compile(eager.fc_concat), "triton": fc_concat}

    rows = []
    for n, k, h_t, h in shapes:
        hidden = torch.randn(n, k, h_t, device=device, dtype=dtype)
        fc_weight = (torch.randn(h, k * h_t, device=device) / (k * h_t) ** 0.5).to(dtype).requires_grad_()
        norm_weight = torch.ones(h, device=device, dtype=dtype, requires_grad=True)
        d_ctx = torch.randn(n, h, device=device, dtype=dtype)
        layouts = {"tensor": hidden, "list": [t.clone() for t in hidden.unbind(1)]}
        # torch.compile does not trace the eager twin's noise generator, so noise compares eager and triton.
        cases = [(layout, 0.0, name) for layout in layouts for name in impls]
        cases += [("tensor", NOISE_STD, name) for name in impls if name != "compiled"]
        group = {}
        for layout, noise_std, name in cases:
            fn, x = impls[name], layouts[layout]

            def forward(fn=fn, x=x, noise_std=noise_std):
                return fn(x, fc_weight, norm_weight, EPS, noise_std, 0)

            def step(forward=forward):
                torch.autograd.grad(forward(), (fc_weight, norm_weight), d_ctx)

            with torch.no_grad():
                fwd_ms = time_ms(forward, **reps)
            row = {
                "N": n, "K": k, "H_t": h_t, "H": h, "dtype": str(dtype).replace("torch.", ""),
                "layout": layout, "noise_std": noise_std, "impl": name,
                "fwd_ms": fwd_ms, "fwd_bwd_ms": time_ms(step, **reps), "peak_mb": peak_memory_mb(step),
            }
            group[(layout, noise_std, name)] = row
            for base in ("eager", "compiled"):
                ref = group.get((layout, noise_std, base))
                if ref is not None and name != base:
                    row[f"speedup_vs_{base}"] = ref["fwd_bwd_ms"] / row["fwd_bwd_ms"]
            rows.append(row)
    print(write_results("fc_concat_smoke" if args.smoke else "fc_concat", rows, args.out))


if __name__ == "__main__":
    main()
