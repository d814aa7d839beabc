"""bench/compile_check.py compiles every Triton kernel for sm_90 without a GPU, so compile errors,
spills and shared-memory overflows show up before a GPU session, and a kernel the tool never
launches fails here.

It needs ptxas, which the triton wheel ships. Where there is none the tool says so and this test
fails with that message instead of skipping: a skipped check is how an uncompilable kernel would
reach the GPU session unnoticed.
"""
import inspect
import json
import os
import re
import subprocess
import sys

import triton
from dflash_fast.kernels import anchored_attention, fc_concat, lm_head_loss
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The reduced run: bf16, the reference shape, the first config of each autotune list, and the cases
# that together launch every kernel once (~20 compiles). The full run is `python bench/compile_check.py`.
QUICK = [
    "--dtypes",
    "bf16",
    "--shapes",
    "reference",
    "--configs",
    "first",
    "--cases",
    "noise=0$|causal=False|kl_topk|kl, store$",
]


def triton_kernels(module):
    """Names of the module's Triton kernels: its @triton.jit functions (under any autotune or
    heuristics wrapper) that no other @triton.jit function of the module calls."""
    jit_types = (JITFunction, InterpretedFunction)  # InterpretedFunction under TRITON_INTERPRET=1
    sources = {}
    for name, obj in vars(module).items():
        while not isinstance(obj, jit_types) and isinstance(getattr(obj, "fn", None), triton.runtime.KernelInterface):
            obj = obj.fn
        if isinstance(obj, jit_types) and obj.fn.__module__ == module.__name__:
            sources[name] = inspect.getsource(obj.fn)
    called = {n for n in sources for other, src in sources.items() if other != n and re.search(rf"\b{n}\(", src)}
    return set(sources) - called


def test_every_kernel_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, os.path.join(REPO, "bench", "compile_check.py"), *QUICK, "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-6000:]}\n{proc.stdout[-2000:]}"
    )
    with open(tmp_path / f"compile_check_{triton.__version__}.json") as f:
        rows = json.load(f)["rows"]
    for module in (fc_concat, anchored_attention, lm_head_loss):
        op = module.__name__.rsplit(".", 1)[-1]
        kernels = triton_kernels(module)
        assert kernels, f"found no Triton kernel in {module.__name__}: the scan is broken"
        compiled = {r["kernel"] for r in rows if r["op"] == op}
        missing = sorted(kernels - compiled)
        assert not missing, (
            f"{op}: compile_check never launched {missing}; add a case that does to bench/compile_check.py and to QUICK"
        )
