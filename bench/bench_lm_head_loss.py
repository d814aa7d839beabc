"""Forward+backward time and peak memory of norm + lm_head + loss: fused kernel vs eager vs Liger.

    python bench/bench_lm_head_loss.py                # N=8192, H=4096, V=151936, bf16, GPU
    python bench/bench_lm_head_loss.py --smoke        # tiny fp32 shapes on CPU (interpreter), for CI
    python bench/bench_lm_head_loss.py --dflash2      # DFlash2's head instead: kl + the selector (K = 16, r = H / 16)

Kinds: `kl` against the full teacher (lm_head(final_norm(last))) and `ce` with stored
labels (no teacher matmul). `triton` is kernels/lm_head_loss.py (logits of 1024-row chunks
kept in fp32: kl 2 + U/N GEMM units, ce 2); the teacher is one row per slot here (U = N), the
drafter's teacher rows shared by overlapping blocks are bench_step.py's business. Peers: eager
(materialised [N, V] logits, fp32 log-softmax) and, when `liger_kernel` imports,
LigerFusedLinearJSD(jsd_beta=0) (forward KL) for `kl` and
LigerFusedLinearCrossEntropyLoss for `ce`; both get the normed states
and include the norm in the timing (their loss is a plain token mean, so the `loss`
column compares eager and triton only). Results: <out>/lm_head_loss.{json,md,png}.

--dflash2: DFlash2's head (spec.md §9) as DFlashDrafter.loss runs it, `kl` plus the candidate selector's loss and its
backward: `triton` is the fused pass with topk = K (the unary top-K and their logits out of the chunk's tiles), the
Triton RMSNorm for the selector's input and the selector scoring those logits (their gradient by one embedding_bag);
`eager` is eager.lm_head_loss with topk = K, the torch norm and the selector over the K gathered lm_head rows. No peer
trains this head (Liger has no top-K). Results: <out>/lm_head_dflash2.{json,md,png}.
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
SELECTOR_TOP_K = 16  # DFlash2's defaults: K = 16, r = 256 at H = 4096
SELECTOR_RANK_PER_H = 1 / 16


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


def dflash2_step(x, fused: bool):
    """One forward + backward of DFlash2's head (kl + the selector's K-way CE, selector_alpha 1) on x's rows."""
    from dflash_fast.kernels import _common

    from dflash_fast.drafter.dflash2 import CandidateSelector, selector_loss

    n, hid = x["h"].shape
    v = x["lm_head_weight"].shape[0]
    torch.manual_seed(0)
    selector = CandidateSelector(v, hid, max(1, int(hid * SELECTOR_RANK_PER_H)), SELECTOR_TOP_K)
    selector = selector.to(x["h"].device, x["h"].dtype)
    prev = torch.roll(x["labels"], 1)
    teacher = Teacher(last=x["last"], final_norm_weight=x["final_norm_weight"])
    loss_fn, norm = (lm_head_loss, _common.rms_norm) if fused else (eager.lm_head_loss, eager.rms_norm)

    def step():
        x["h"].grad = x["norm_weight"].grad = None
        selector.zero_grad()
        out = loss_fn(x["h"], x["norm_weight"], x["lm_head_weight"], x["weights"], "kl", n, EPS, teacher,
                      topk=SELECTOR_TOP_K)
        hidden = norm(x["h"], x["norm_weight"], EPS)
        sel = selector_loss(selector, hidden, x["lm_head_weight"], prev, out.topk_ids, out.teacher_argmax,
                            x["weights"], torch.tensor(n, device=x["h"].device), None,
                            out.topk_logits if fused else None)
        loss = out.loss + sel.loss
        loss.backward()
        return loss.detach()

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
    parser.add_argument("--dflash2", action="store_true", help="DFlash2's head (kl + the candidate selector), "
                        "triton vs eager, into lm_head_dflash2.json")
    args = parser.parse_args(argv)
    if args.smoke:
        device, dtype, (n, hid, v), warmup, rep = "cpu", torch.float32, (64, 64, 1000), 1, 2
    elif torch.cuda.is_available():
        device, dtype, (n, hid, v), warmup, rep = "cuda", torch.bfloat16, (args.n, args.hidden, args.vocab), 3, 10
    else:
        parser.error("the full benchmark needs a CUDA GPU; use --smoke on CPU")
    x = make_inputs(n, hid, v, dtype, device)
    if args.dflash2:
        return dflash2_rows(x, n, hid, v, dtype, warmup, rep, args.out)
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


def dflash2_rows(x, n, hid, v, dtype, warmup, rep, out):
    base = {"kind": f"kl + DFlash2 selector (K = {SELECTOR_TOP_K})", "N": n, "H": hid, "V": v,
            "dtype": str(dtype).replace("torch.", "")}
    rows = []
    for impl, fused in (("eager", False), ("triton", True)):
        loss, ms, peak, note = measure(dflash2_step(x, fused), warmup, rep)
        rows.append({**base, "impl": impl, "ms": ms, "peak_mb": peak, "loss": loss, "note": note})
    eager_row, row = rows
    if eager_row["ms"] and row["ms"]:
        row["speedup_vs_eager"] = eager_row["ms"] / row["ms"]
        if row["peak_mb"] is not None and eager_row["peak_mb"]:
            row["peak_vs_eager"] = row["peak_mb"] / eager_row["peak_mb"]
    print(write_results("lm_head_dflash2", rows, out, plot={"x": "kind", "y": "ms", "group": "impl"}))


if __name__ == "__main__":
    main()
