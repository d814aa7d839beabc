"""Forward+backward time and peak memory of norm + lm_head + loss: fused kernel vs eager vs Liger.

    python bench/bench_lm_head_loss.py                # N=8192, H=4096, V=151936, bf16, GPU
    python bench/bench_lm_head_loss.py --smoke        # tiny fp32 shapes on CPU (interpreter), for CI

Kinds: `kl` against the full teacher (lm_head(final_norm(last))) and `ce` with stored
labels (no teacher matmul). `triton` is kernels/lm_head_loss.py (logits of 1024-row chunks
kept in fp32: kl 2 + U/N GEMM units, ce 2); the teacher is one row per slot here (U = N), the
drafter's teacher rows shared by overlapping blocks are bench_step.py's business. Peers: eager
(materialised [N, V] logits, fp32 log-softmax) and, when `liger_kernel` imports,
LigerFusedLinearJSD(jsd_beta=0) (forward KL) for `kl` and
LigerFusedLinearCrossEntropyLoss for `ce`; both get the normed states
and include the norm in the timing (their loss is a plain token mean, so the `loss`
column compares eager and triton only). Results: <out>/lm_head_loss.{json,md,png}.
"""
import argparse
import os
import sys

import torch

if "--smoke" in sys.argv or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit module is imported
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflash_fast.kernels.lm_head_loss import lm_head_loss  # noqa: E402

from bench.harness import peak_memory_mb, time_ms, write_results  # noqa: E402
from dflash_fast.drafter import eager  # noqa: E402
from dflash_fast.drafter.eager import Teacher  # noqa: E402

EPS = 1e-6
KINDS = {"kl": ("kl", False), "ce (stored labels)": ("ce", True)}


def make_inputs(n, hid, v, dtype, device):
    gen = torch.Generator(device=device).manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device=device, dtype=dtype)
    return dict(
        h=rand(n, hid).requires_grad_(),
        norm_weight=torch.ones(hid, device=device, dtype=dtype).requires_grad_(),
        lm_head_weight=rand(v, hid) * hid**-0.5 * 4,
        last=rand(n, hid),
        final_norm_weight=torch.ones(hid, device=device, dtype=dtype),
        weights=torch.rand(n, generator=gen, device=device),
        labels=torch.randint(0, v, (n,), generator=gen, device=device),
    )


def ours_or_eager(fn, x, kind, stored_labels):
    teacher = Teacher(last=x["last"], final_norm_weight=x["final_norm_weight"])
    if stored_labels:
        teacher = Teacher(labels=x["labels"])

    def step():
        x["h"].grad = x["norm_weight"].grad = None
        out = fn(x["h"], x["norm_weight"], x["lm_head_weight"], x["weights"], kind, x["h"].shape[0], EPS, teacher)
        out.loss.backward()
        return out.loss.detach()

    return step


def liger_step(x, kind):
    """Liger's fused linear loss on the normed states; raises ImportError when liger_kernel is absent."""
    if kind == "kl":
        from liger_kernel.transformers import LigerFusedLinearJSD

        loss_fn = LigerFusedLinearJSD(jsd_beta=0.0)
    else:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        loss_fn = LigerFusedLinearCrossEntropyLoss()
    with torch.no_grad():
        teacher = eager.rms_norm(x["last"], x["final_norm_weight"], EPS)

    def step():
        x["h"].grad = x["norm_weight"].grad = None
        student = eager.rms_norm(x["h"], x["norm_weight"], EPS)
        if kind == "kl":
            loss = loss_fn(student, x["lm_head_weight"], teacher, x["lm_head_weight"])
        else:
            loss = loss_fn(x["lm_head_weight"], student, x["labels"])
        loss.backward()
        return loss.detach()

    return step


def measure(step, warmup, rep):
    """(loss of a first call, median ms, peak MB, note) of one forward+backward step."""
    try:
        loss = step().float().item()
        return loss, time_ms(step, warmup=warmup, rep=rep), peak_memory_mb(step), ""
    except torch.cuda.OutOfMemoryError as err:
        return None, None, None, f"out of memory: {str(err).splitlines()[0]}"
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke", action="store_true", help="tiny fp32 shapes on CPU; CPU times are not a performance claim"
    )
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    args = parser.parse_args(argv)
    if args.smoke:
        device, dtype, (n, hid, v), warmup, rep = "cpu", torch.float32, (64, 64, 1000), 1, 2
    elif torch.cuda.is_available():
        device, dtype, (n, hid, v), warmup, rep = "cuda", torch.bfloat16, (args.n, args.hidden, args.vocab), 3, 10
    else:
        parser.error("the full benchmark needs a CUDA GPU; use --smoke on CPU")
    x = make_inputs(n, hid, v, dtype, device)
    rows = []
    for label, (kind, stored_labels) in KINDS.items():
        impls = {
            "eager": lambda: ours_or_eager(eager.lm_head_loss, x, kind, stored_labels),
            "triton": lambda: ours_or_eager(lm_head_loss, x, kind, stored_labels),
            "liger": lambda: liger_step(x, kind),
        }
        base = {"kind": label, "N": n, "H": hid, "V": v, "dtype": str(dtype).replace("torch.", "")}
        eager_row = None
        for impl, make in impls.items():
            try:
                loss, ms, peak, note = measure(make(), warmup, rep)
            except ImportError as err:
                rows.append({**base, "impl": impl, "ms": None, "peak_mb": None, "note": f"not installed ({err})"})
                continue
            except Exception as err:  # a peer's version may reject beta=0 or these shapes: record why
                if impl != "liger":
                    raise
                rows.append(
                    {**base, "impl": impl, "ms": None, "peak_mb": None, "note": f"failed: {type(err).__name__}: {err}"}
                )
                continue
            row = {**base, "impl": impl, "ms": ms, "peak_mb": peak, "loss": loss, "note": note}
            if impl == "eager":
                eager_row = row
            elif eager_row and eager_row["ms"] and ms:
                row["speedup_vs_eager"] = eager_row["ms"] / ms
                if peak is not None and eager_row["peak_mb"]:
                    row["peak_vs_eager"] = peak / eager_row["peak_mb"]
            rows.append(row)
    print(write_results("lm_head_loss", rows, args.out, plot={"x": "kind", "y": "ms", "group": "impl"}))


if __name__ == "__main__":
    main()
