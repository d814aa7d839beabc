"""Compile every Triton kernel of kernels/ for a GPU (default: H200, sm_90) on a machine without one.

The kernel modules are imported with the autotune lists they use on a GPU, and their public entry
points (`fc_concat`, `anchored_attention`, `lm_head_loss`, `grouped_dynamic_conv`) run forward and backward on
CPU tensors at the drafter's reference shape, in every variant their constexpr switches have. Triton's launch is
intercepted: each (kernel, signature, constexprs, autotune config) that a GPU run would compile is
compiled for `GPUTarget("cuda", arch, 32)` (TTIR -> TTGIR -> LLVM IR -> PTX -> ptxas cubin) and
nothing is launched, so no CUDA driver is needed. Each compile records registers and spills (from
`ptxas -v`), shared memory (Triton's allocation, checked against the arch's per-block opt-in limit,
which a launch would enforce), compile seconds, or the error, and static facts read off the emitted
PTX and the launch (`bench/static_facts.py`):

  * loops: llc's loop comments on each basic block say which instructions each loop holds;
    `mma_loops_without_async` counts the loops with MMA instructions and no asynchronous copy (every
    iteration of such a loop waits for its loads);
  * the main loop, the innermost loop with the most MMA instructions (the most instructions when there
    is none): its asynchronous copies (cp.async, TMA cp.async.bulk: what the software pipeliner
    issues), its synchronous global loads (ld.global, each one waited for inside the loop), its MMA
    instruction shapes (wgmma m64nNk16, mma.sync m16n8k16) and the widest and narrowest N among them;
    the MMA shapes outside it;
  * ptxas's "Potential Performance Loss" remarks (wgmma serialisation);
  * programs of the launch, how many fit on one SM at once (registers, shared memory, warps, blocks)
    and the waves they make on the arch's SMs at the case's shape.

    python bench/compile_check.py        # everything: bf16, fp16, fp32; reference, long, ragged shapes; every config
    python bench/compile_check.py --dtypes bf16 --shapes reference --configs first \
        --cases 'noise=0$|causal=False|kl_topk| kl$| tv$| lk$|lk_hybrid|rkl|jsd'   # tests/test_compile_check.py
    python bench/compile_check.py --arch 90 --out bench/results --fail-on-spills

Writes <out>/compile_check_<triton version>.{json,md} (default out: bench/results) and prints the
table. Exit 1 if any compile fails, or a launch would raise OutOfResources (shared memory above the
limit) where no autotune config is left to take its place; an autotune config the autotuner would
skip, and every spill, is a WARNING line (spills fail with --fail-on-spills).
Needs ptxas, which the triton wheel ships in triton/backends/nvidia/bin/ (TRITON_PTXAS_PATH
overrides it), and TRITON_INTERPRET unset. Every compile starts from an empty Triton cache, so the
seconds are real compile times.

Shapes (`REFERENCE`): the Qwen3-8B drafter of bench_step.py, H = H_t = 4096, K = 5, Hq/Hkv = 32/8,
D = 128, V = 151936, B = 16, A = 512, T = 3072. `RAGGED` changes the sizes that are free in training
(token counts, anchors, a target width not a multiple of 64) so that the kernels' masked tails
(EVEN_T / EVEN_N false) and unaligned integer arguments compile too. The attention window is not a
kernel switch (it only moves the per-anchor bounds on the host), so it adds no variant. `long`
(T = 8192) recompiles the ops whose sizes it changes (the specialisation is the reference's) for
their programs and waves at 8192 tokens; like `ragged` it runs in bf16 only.
"""

import argparse
import contextlib
import hashlib
import io
import math
import os
import re
import shutil
import sys
import tempfile
import time
import types
from typing import Callable, Dict, List, Optional

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("compile_check compiles for a GPU: unset TRITON_INTERPRET (the interpreter never compiles a kernel)")
# The cache must be empty so that every compile runs ptxas (its log is where registers come from).
_CACHE_DIR = tempfile.mkdtemp(prefix="compile_check_cache_")
os.environ["TRITON_CACHE_DIR"] = _CACHE_DIR

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import write_results  # noqa: E402
from bench.static_facts import (  # noqa: E402
    ARCHS,
    BLOCKS_PER_SM,
    REGISTERS_PER_SM,
    SMEM_RESERVED_PER_BLOCK,
    STATIC_FACTS,
    WARPS_PER_SM,
    occupancy,
    static_facts,
)
from dflash_fast.store.format import torch_dtype  # noqa: E402

KERNELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")
REFERENCE = dict(H=4096, H_t=4096, K=5, Hq=32, Hkv=8, D=128, V=151936, B=16, A=512, T=3072, docs=4)
RAGGED = dict(REFERENCE, H_t=4000, A=509, T=3001)
LONG = dict(REFERENCE, T=8192)
SHAPES = {"reference": REFERENCE, "long": LONG, "ragged": RAGGED}
# The sizes each op's cases read: a shape that leaves all of an op's sizes at the reference adds nothing.
OP_SIZES = {
    "fc_concat": ("T", "K", "H_t", "H"),
    "anchored_attention": ("Hq", "Hkv", "D", "B", "A", "T", "docs"),
    "lm_head_loss": ("A", "B", "H", "V", "T"),  # T: the teacher rows the slots index
    "grouped_dynamic_conv": ("A", "B", "H"),
}
EPS = 1e-6
TOPK = 8


class CompileOnlyDriver:
    """Stands in for the CUDA driver: Triton asks it only for the device, stream and target."""

    def __init__(self, target: GPUTarget):
        self.target = target

    def get_current_device(self):
        return 0

    def get_current_stream(self, _device=None):
        return 0

    def get_current_target(self):
        return self.target


class CompileRecorder:
    """Makes every kernel launch compile for `target` instead of running, one record per compile.

    `Autotuner.run` walks every config its pruning keeps (a GPU run benchmarks each one, so each
    one is compiled there); `JITFunction.run` binds and specialises the arguments exactly as a
    launch does, then stops where a launch would load the cubin; `JITFunction._do_compile`, called
    once per new specialisation, is timed and its ptxas log captured.
    """

    def __init__(self, arch: int, configs: str):
        self.arch = arch
        self.configs = configs
        self.case, self.dtype = "", ""
        self.autotune: Optional[Dict[str, object]] = None
        self.records: List[Dict[str, object]] = []
        self.programs: Optional[int] = None  # of the launch being compiled
        self._failed = set()
        self._kernels = set()

    def forget_compiled(self) -> None:
        """Drop the kernel caches (in memory and on disk), so that a new shape whose specialisations equal an
        earlier one's compiles again and records its own programs and waves."""
        for fn in self._kernels:
            fn.device_caches.clear()
        shutil.rmtree(_CACHE_DIR, ignore_errors=True)
        os.makedirs(_CACHE_DIR)

    def install(self) -> None:
        driver.set_active(CompileOnlyDriver(GPUTarget("cuda", self.arch, 32)))
        knobs.nvidia.dump_ptxas_log = True  # printed to stdout by the CUDA backend, captured per compile
        recorder, jit_run, do_compile = self, JITFunction.run, JITFunction._do_compile

        def autotuner_run(tuner, *args, **kwargs):
            tuner.nargs = dict(zip(tuner.arg_names, args))
            configs = tuner.prune_configs(kwargs)
            first = len(recorder.records)
            for i, config in enumerate(configs if recorder.configs == "all" else configs[:1]):
                recorder.autotune = dict(config.kwargs, index=f"{i + 1}/{len(configs)}")
                try:
                    tuner.fn.run(*args, **kwargs, **config.all_kwargs())
                finally:
                    recorder.autotune = None
            tuner.nargs = None
            launch = recorder.records[first:]
            if recorder.configs == "all" and launch and not any(r["status"] in ("ok", "spills") for r in launch):
                for r in launch:  # the autotuner has no config left to run: the launch fails on a GPU
                    r["status"], r["error"] = "error", r["error"] + "; no config of this autotune list fits"

        def run(fn, *args, grid, warmup, **kwargs):  # noqa: ARG001 (a launch never warms up here)
            recorder._kernels.add(fn)
            recorder.programs = _programs(fn, grid, args, kwargs)
            try:
                return jit_run(fn, *args, grid=grid, warmup=True, **kwargs)
            except Exception as err:  # binding or specialising the arguments failed, before any compile
                recorder.records.append(recorder.row(fn, {}, {}, None, 0.0, "", None, err))

        def _do_compile(fn, key, signature, device, constexprs, options, attrs, warmup):
            if (fn, key) in recorder._failed:
                return None
            log = io.StringIO()
            t0 = time.perf_counter()
            kernel, error = None, None
            try:
                with contextlib.redirect_stdout(log):
                    kernel = do_compile(fn, key, signature, device, constexprs, options, attrs, warmup)
            except Exception as err:  # a compile error, ptxas failure or compile-time assertion
                error = err
                recorder._failed.add((fn, key))
            recorder.records.append(
                recorder.row(
                    fn, signature, constexprs, options, time.perf_counter() - t0, log.getvalue(), kernel, error
                )
            )
            print(_progress(recorder.records[-1]), flush=True)
            return kernel

        Autotuner.run = autotuner_run
        JITFunction.run = run
        JITFunction._do_compile = _do_compile

    def row(self, fn, signature, constexprs, options, seconds, log, kernel, error) -> Dict[str, object]:
        names = list(signature)
        consts = {_path_name(names, path): _value(v) for path, v in constexprs.items()}
        tile = set(self.autotune or ()) - {"index"}
        row = {
            "op": fn.module.rsplit(".", 1)[-1],
            "kernel": fn.__name__,
            "case": self.case,
            "dtype": self.dtype,
            "variant": " ".join(f"{k}={v}" for k, v in consts.items() if k not in tile and not k.startswith("BLOCK_")),
            "config": " ".join(f"{k}={v}" for k, v in consts.items() if k in tile or k.startswith("BLOCK_")),
            "autotune": (self.autotune or {}).get("index", ""),
            "warps": getattr(options, "num_warps", None),
            "stages": getattr(options, "num_stages", None),
            "n_regs": None,
            "n_spills": None,
            "spill_store_bytes": None,
            "smem_bytes": None,
            **dict.fromkeys(STATIC_FACTS),
            "programs": self.programs,
            "per_sm": None,
            "waves": None,
            "compile_s": round(seconds, 2),
            "status": "ok",
            "error": "",
        }
        if error is None and kernel is not None:
            row.update(_ptxas_usage(log))
            row["smem_bytes"] = kernel.metadata.shared
            row.update(static_facts(kernel.asm["ptx"], log))
            if row["n_regs"] is not None:
                row.update(occupancy(self.arch, row["n_regs"], row["warps"], row["smem_bytes"], self.programs))
            limit = ARCHS[self.arch]["smem"]
            if row["n_regs"] is None:
                error = f"no register count in the ptxas log (knobs.nvidia.dump_ptxas_log): {log[-500:]!r}"
            elif row["smem_bytes"] > limit:
                row["error"] = (
                    f"OutOfResources: {row['smem_bytes']} bytes of shared memory, sm_{self.arch} allows {limit}"
                )
            elif row["n_regs"] * row["warps"] * 32 > REGISTERS_PER_SM:
                row["error"] = (
                    f"OutOfResources: {row['n_regs']} registers x {row['warps'] * 32} threads > {REGISTERS_PER_SM}"
                )
            elif row["spill_store_bytes"] or row["n_spills"]:
                row["status"] = "spills"
            if row["error"]:
                # A launch raises OutOfResources; the autotuner catches it and skips the config.
                row["status"] = "out of resources" if self.autotune else "error"
        if error is not None:
            row["status"] = "error"
            row["error"] = f"{type(error).__name__}: {error}" if isinstance(error, Exception) else error
        return row


def _programs(fn, grid, args, kwargs) -> Optional[int]:
    """Programs of a launch: its grid evaluated on the launch's arguments, as `JITFunction.run` does."""
    try:
        dims = grid(dict(zip(fn.arg_names, args), **kwargs)) if callable(grid) else grid
        return math.prod(int(d) for d in dims)
    except Exception:  # a grid that needs more than the arguments: the row says programs = None
        return None


def _path_name(names: List[str], path) -> str:
    """(3,) -> 'K'; (0, 2) -> 'X[2]' (an element of a tuple argument)."""
    return names[path[0]] + "".join(f"[{i}]" for i in path[1:]) if names else str(path)


def _value(v):
    v = getattr(v, "value", v)  # tl.constexpr
    return v if isinstance(v, (int, float, bool, str)) else str(v)


def _ptxas_usage(log: str) -> Dict[str, Optional[int]]:
    """Registers and spills from `ptxas -v`. n_spills follows triton's CompiledKernel.n_spills:
    local memory (the stack frame) in 4-byte words."""
    regs = re.search(r"Used (\d+) registers", log)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {
        "n_regs": int(regs.group(1)) if regs else None,
        "n_spills": int(frame.group(1)) // 4 if frame else None,
        "spill_store_bytes": int(frame.group(2)) if frame else None,
    }


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def _one_line(text: str, limit: int = 600) -> str:
    """An error as one Markdown table cell: whitespace collapsed, pipes escaped, the tail kept (where
    Triton puts the message, after the source excerpt)."""
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= limit else "..." + text[-limit:]


def _progress(r: Dict[str, object]) -> str:
    usage = (
        f"{r['n_regs']} regs, {r['n_spills']} spills, {r['smem_bytes']} B smem, main loop: "
        f"{r['main_loop_async_copies']} async copies, {r['main_loop_sync_loads']} sync loads, {r['main_loop_mma']}; "
        f"{r['programs']} programs, {r['per_sm']}/SM, {r['waves']} waves"
        if r["status"] != "error"
        else "ERROR"
    )
    return (
        f"  {r['compile_s']:6.2f}s {r['kernel']} {r['dtype']} {r['variant']} {r['config']} "
        f"w{r['warps']} s{r['stages']}: {usage}"
    )


def import_kernels_for_gpu(sms: int):
    """Import the kernel modules as on a GPU machine: their config lists (and GPU-only sizes
    such as lm_head_loss.VOCAB_CHUNK) are chosen at import from torch.cuda.is_available().

    Two host-side guards are lifted for this process only, because no CPU tensor reaches a kernel:
    the kernels refuse CPU tensors outside the interpreter (`_common.check_device`), and the host
    code asks the CUDA device for its SM count (which sizes split and persistent grids).
    """
    is_available = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        from dflash_fast.kernels import _common, anchored_attention, fc_concat, grouped_dynamic_conv, lm_head_loss
    finally:
        torch.cuda.is_available = is_available
    if not _common.ON_GPU:
        raise RuntimeError(
            "dflash_fast.kernels._common did not pick the GPU configs (ON_GPU is False): compile_check "
            "expects it to decide from torch.cuda.is_available() at import, and must import it first"
        )
    _common.INTERPRET = True
    torch.cuda.get_device_properties = lambda _device=None: types.SimpleNamespace(multi_processor_count=sms)
    return fc_concat, anchored_attention, lm_head_loss, grouped_dynamic_conv


def _empty(*shape, dtype, grad=False):
    return torch.empty(shape, dtype=dtype).requires_grad_(grad)


def fc_concat_cases(mod, s, dtype) -> Dict[str, Callable[[], None]]:
    """Forward (fc GEMM + norm) and backward (norm backward + weight-gradient GEMM per layer), noise off and on."""
    n, k, h_t, h = s["T"], s["K"], s["H_t"], s["H"]

    def step(noise_std):
        ctx = mod.fc_concat(
            _empty(n, k, h_t, dtype=dtype),
            _empty(h, k * h_t, dtype=dtype, grad=True),
            _empty(h, dtype=dtype, grad=True),
            EPS,
            noise_std=noise_std,
            seed=1,
        )
        ctx.backward(torch.empty_like(ctx))

    return {"noise=0": lambda: step(0.0), "noise=0.1": lambda: step(0.1)}


def anchored_attention_cases(mod, s, dtype) -> Dict[str, Callable[[], None]]:
    """Forward, block pass, dQ and context dK/dV, causal in block off and on."""
    r, a, b, t, hq, hkv, d = 1, s["A"], s["B"], s["T"], s["Hq"], s["Hkv"], s["D"]
    anchors = torch.linspace(t // 8, t - 1, a).long()[None]
    document_ids = (torch.arange(t) * s["docs"] // t)[None]

    def step(causal):
        q = _empty(r, a * b, hq, d, dtype=dtype, grad=True)
        kv = [_empty(r, n, hkv, d, dtype=dtype, grad=True) for n in (t, t, a * b, a * b)]
        out = mod.anchored_attention(
            q, *kv, anchors, torch.ones_like(anchors, dtype=torch.bool), document_ids, b, causal_in_block=causal
        )
        out.backward(torch.empty_like(out))

    return {"causal=False": lambda: step(False), "causal=True": lambda: step(True)}


def lm_head_loss_cases(mod, s, dtype) -> Dict[str, Callable[[], None]]:
    """Every loss kind (the full teacher's `last` is the row's T positions, which the A*B slots index, as the
    drafter passes it); D-PACE weights (no kernel of their own, checked with kl); a trainable lm_head (its
    weight-gradient GEMM; the drafter's head is frozen); DSpark's Markov bias (the logits GEMM's HAS_BIAS
    columns, r = H / 16, and the de / dW2 GEMMs); DFlash2's selector (spec.md §9): the pass with topk = 16 (its top-K
    is host code over the kernels' outputs: no kernel of its own) and the selector's input norm by the Triton
    RMSNorm with autograd (kernels/_common.py rms_norm: its backward is the HAS_SCALE=False variant, which the loss
    never launches).

    Every launch happens in the forward, which computes the gradients; the backward only scales them
    (no kernel), so it is not run: at V = 151936 it would write gigabytes of host memory for nothing.
    """
    n, h, v, t = s["A"] * s["B"], s["H"], s["V"], s["T"]
    index = torch.linspace(0, t - 1, n).long()

    def step(kind, with_labels=True, train_head=False, dpace=False, markov=False, topk=0):
        teacher = mod.Teacher(last=_empty(t, h, dtype=dtype), final_norm_weight=_empty(h, dtype=dtype), index=index)
        if kind in ("ce", "ce_data") and with_labels:
            teacher = mod.Teacher(labels=torch.randint(0, v, (n,)))
        elif kind == "kl_topk":
            teacher = mod.Teacher(
                topk_ids=torch.randint(0, v, (n, TOPK)), topk_logits=torch.zeros(n, TOPK), topk_lse=torch.zeros(n)
            )
        mod.lm_head_loss(
            _empty(n, h, dtype=dtype, grad=True),
            _empty(h, dtype=dtype, grad=True),
            _empty(v, h, dtype=dtype, grad=train_head),
            torch.ones(n),
            kind,
            float(n),
            EPS,
            teacher,
            mod.DPace(0.5, s["B"]) if dpace else None,
            mod.Markov(_empty(n, h // 16, dtype=dtype, grad=True), _empty(v, h // 16, dtype=dtype, grad=True))
            if markov else None,
            topk=topk,
        )

    def dflash2_selector():
        from dflash_fast.kernels import _common

        step("kl", topk=16)
        y = _common.rms_norm(_empty(n, h, dtype=dtype, grad=True), _empty(h, dtype=dtype, grad=True), EPS)
        y.backward(torch.empty_like(y))

    return {
        "kl": lambda: step("kl"),
        "kl_topk": lambda: step("kl_topk"),
        "ce(labels)": lambda: step("ce"),
        "ce(teacher argmax)": lambda: step("ce", with_labels=False),
        "ce_data": lambda: step("ce_data"),
        "kl, D-PACE": lambda: step("kl", dpace=True),
        "kl, lm_head trained": lambda: step("kl", train_head=True),
        **{kind: (lambda kind=kind: step(kind)) for kind in ("tv", "lk", "lk_hybrid", "rkl", "jsd")},
        "kl, DSpark Markov bias": lambda: step("kl", markov=True),
        "kl, DFlash2 selector": dflash2_selector,
    }


def grouped_dynamic_conv_cases(mod, s, dtype) -> Dict[str, Callable[[], None]]:
    """DFlash2's convolution (spec.md §9), forward and backward, at N = A x B slots: its default (taps 2, groups of 16)
    with delta read in place as a slice of the kernel projection's [N, 2, taps, G] output, as DynamicConv reads it,
    and taps 3 in groups of 128 (another GS and group tile); conv_in without a residual, conv_out with the residual
    add fused (HAS_RESIDUAL), as a DFlash2 sublayer runs them."""
    n, h, b = s["A"] * s["B"], s["H"], s["B"]

    def step(taps, group):
        projection = _empty(n, 2, taps, h // group, dtype=dtype, grad=True)
        base = _empty(2, taps, h, dtype=dtype, grad=True)
        y = mod.grouped_dynamic_conv(_empty(n, h, dtype=dtype, grad=True), projection[:, 0], base[0], b, group)
        z = mod.grouped_dynamic_conv(y, projection[:, 1], base[1], b, group, _empty(n, h, dtype=dtype, grad=True))
        z.backward(torch.empty_like(z))

    return {"taps=2 group=16": lambda: step(2, 16), "taps=3 group=128": lambda: step(3, 128)}


CASES = {
    "fc_concat": fc_concat_cases,
    "anchored_attention": anchored_attention_cases,
    "lm_head_loss": lm_head_loss_cases,
    "grouped_dynamic_conv": grouped_dynamic_conv_cases,
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join("bench", "results"), help="results folder (default bench/results)")
    p.add_argument(
        "--arch", type=int, default=90, choices=sorted(ARCHS), help="CUDA compute capability (90: H100/H200)"
    )
    p.add_argument("--dtypes", default="bf16,fp16,fp32", help="comma-separated, of bf16, fp16, fp32")
    p.add_argument(
        "--shapes", default="reference,long,ragged", help="comma-separated, of " + ", ".join(SHAPES)
    )
    p.add_argument(
        "--configs", default="all", choices=["all", "first"], help="every autotune config, or the first of each list"
    )
    p.add_argument(
        "--cases", default="", help="regex: run only the cases whose label ('<op> <dtype> <shape> <case>') matches"
    )
    p.add_argument("--ops", default=",".join(CASES), help="comma-separated subset of " + ", ".join(CASES))
    p.add_argument("--fail-on-spills", action="store_true", help="exit 1 when any kernel spills registers")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    try:
        tool = get_ptxas(args.arch)  # the ptxas triton itself will call for this arch
        ptxas = f"{tool.path} (CUDA {tool.version})"
    except Exception as err:  # knobs raise when the binary is missing or does not run
        sys.exit(
            f"no ptxas for sm_{args.arch}: {err}. The triton wheel ships it in triton/backends/nvidia/bin/; "
            "set TRITON_PTXAS_PATH to a CUDA toolkit's ptxas otherwise"
        )
    modules = {m.__name__.rsplit(".", 1)[-1]: m for m in import_kernels_for_gpu(ARCHS[args.arch]["sms"])}
    recorder = CompileRecorder(args.arch, args.configs)
    recorder.install()
    t0 = time.perf_counter()
    try:
        for shape in args.shapes.split(","):
            recorder.forget_compiled()
            for dtype in args.dtypes.split(","):
                if shape != "reference" and dtype != "bf16":
                    continue  # masked tails and grids are dtype-independent; bf16 is the training dtype
                for op in args.ops.split(","):
                    if shape != "reference" and all(SHAPES[shape][k] == REFERENCE[k] for k in OP_SIZES[op]):
                        continue
                    for name, step in CASES[op](modules[op], SHAPES[shape], torch_dtype(dtype)).items():
                        recorder.case, recorder.dtype = f"{op} {dtype} {shape} {name}", dtype
                        if re.search(args.cases, recorder.case):
                            print(recorder.case, flush=True)
                            step()
    finally:
        shutil.rmtree(_CACHE_DIR, ignore_errors=True)
    seconds = time.perf_counter() - t0

    rows = recorder.records
    errors = [r for r in rows if r["status"] == "error"]
    spills = [r for r in rows if r["status"] == "spills"]
    too_big = [r for r in rows if r["status"] == "out of resources"]
    meta = {
        "target": f"cuda sm_{args.arch} ({ARCHS[args.arch]['gpu']}), warp 32, smem limit {ARCHS[args.arch]['smem']} B",
        "ptxas": ptxas,
        # The tree may be dirty: these name the kernel sources the rows belong to.
        "kernel_sha256": {
            name: _sha256(os.path.join(KERNELS_DIR, name))
            for name in sorted(os.listdir(KERNELS_DIR))
            if name.endswith(".py") and name != "__init__.py"
        },
        "dtypes": args.dtypes,
        "shapes": args.shapes,
        "configs": args.configs,
        "compiles": len(rows),
        "errors": len(errors),
        "spilling": len(spills),
        "out_of_resources": len(too_big),
        "total_s": round(seconds, 1),
        "static facts": "mma_loops_without_async = PTX loops with MMA instructions and no async copy; main loop = "
        "the innermost PTX loop with the most MMA instructions; async copies = "
        "cp.async / cp.async.bulk (TMA) in it, sync loads = ld.global in it; per_sm = programs resident on one SM "
        f"(registers in 256-per-warp units of {REGISTERS_PER_SM}, shared memory + {SMEM_RESERVED_PER_BLOCK} B of "
        f"{ARCHS[args.arch]['smem_per_sm']} B, {WARPS_PER_SM} warps, {BLOCKS_PER_SM} blocks); waves = programs / "
        f"(per_sm x {ARCHS[args.arch]['sms']} SMs) at the case's shape",
        "shapes (sizes)": {name: SHAPES[name] for name in args.shapes.split(",")},
    }
    name = f"compile_check_{triton.__version__}"
    print(write_results(name, [dict(r, error=_one_line(r["error"])) for r in rows], args.out, meta=meta))
    for r in spills:
        print(
            f"WARNING: {r['kernel']} {r['dtype']} {r['variant']} {r['config']} w{r['warps']} s{r['stages']} spills "
            f"({r['spill_store_bytes']} bytes of spill stores, {r['n_regs']} registers)",
            file=sys.stderr,
        )
    for r in too_big:
        print(
            f"WARNING: {r['kernel']} {r['dtype']} {r['variant']} {r['config']} w{r['warps']} s{r['stages']} is a dead "
            f"autotune config (the autotuner skips it): {r['error']}",
            file=sys.stderr,
        )
    for r in errors:
        print(
            f"ERROR: {r['kernel']} {r['dtype']} {r['variant']} {r['config']} w{r['warps']} "
            f"s{r['stages']}: {r['error'][:2000]}",
            file=sys.stderr,
        )
    print(
        f"{len(rows)} compiles for sm_{args.arch} with triton {triton.__version__} in {seconds:.0f} s: "
        f"{len(errors)} failed, "
        f"{len(spills)} spill, {len(too_big)} autotune configs out of resources; results in "
        f"{os.path.join(args.out, name)}.{{json,md}}"
    )
    return 1 if errors or (spills and args.fail_on_spills) else 0


if __name__ == "__main__":
    sys.exit(main())
