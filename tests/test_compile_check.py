"""bench/compile_check.py compiles every Triton kernel for sm_90 without a GPU, so compile errors,
spills and shared-memory overflows show up before a GPU session, and a kernel the tool never
launches fails here; the hot kernels' compiled main loops must stay pipelined and full-width.

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

import pytest
import triton
from dflash_fast.kernels import anchored_attention, fc_concat, grouped_dynamic_conv, lm_head_loss
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from bench import compile_diff, static_facts

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The reduced run: bf16, the reference shape, the first config of each autotune list, and the cases
# that together launch every kernel once and every loss kind's row pass (~30 compiles). The full run is
# `python bench/compile_check.py`.
QUICK = [
    "--dtypes",
    "bf16",
    "--shapes",
    "reference",
    "--configs",
    "first",
    "--cases",
    "noise=0$|causal=False|kl_topk| kl$| tv$| lk$|lk_hybrid|rkl|jsd|taps=2 group=16",  # every loss row pass variant
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


def run_compile_check(out_dir, *args):
    """Rows of one compile_check run (which must exit 0) written to out_dir."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, os.path.join(REPO, "bench", "compile_check.py"), *args, "--out", str(out_dir)]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-6000:]}\n{proc.stdout[-2000:]}"
    )
    with open(out_dir / f"compile_check_{triton.__version__}.json") as f:
        return json.load(f)["rows"]


def test_every_kernel_compiles_for_sm90(tmp_path):
    rows = run_compile_check(tmp_path, *QUICK)
    for module in (fc_concat, anchored_attention, lm_head_loss, grouped_dynamic_conv):
        op = module.__name__.rsplit(".", 1)[-1]
        kernels = triton_kernels(module)
        assert kernels, f"found no Triton kernel in {module.__name__}: the scan is broken"
        compiled = {r["kernel"] for r in rows if r["op"] == op}
        missing = sorted(kernels - compiled)
        assert not missing, (
            f"{op}: compile_check never launched {missing}; add a case that does to bench/compile_check.py and to QUICK"
        )


def test_no_bf16_config_of_the_loss_spills_for_any_kind_at_the_reference_shape(tmp_path):
    """Every autotune config that the autotuner keeps for every loss kind's kernels (the row pass's variants above
    all: its (1, 1024) tile spilled 4-8 bytes for lk and rkl under Triton 3.9) and for DSpark's Markov bias
    compiles for sm_90 without spills in bf16: the autotuner may pick any of them. DFlash2's selector adds the
    Triton RMSNorm's backward without a row scale (its input norm, kernels/_common.py rms_norm)."""
    rows = run_compile_check(tmp_path, "--ops", "lm_head_loss", "--dtypes", "bf16", "--shapes", "reference",
                             "--configs", "all", "--cases", " kl$|kl_topk| tv$| lk$|lk_hybrid|rkl|jsd|DSpark|DFlash2")
    assert {r["variant"].split("KIND=")[-1] for r in rows if r["kernel"] == "_dlogits_bwd_kernel"} >= {
        "kl", "tv", "lk", "lk_hybrid", "rkl", "jsd"}
    assert any("HAS_MARKOV=True" in r["variant"] for r in rows if r["kernel"] == "_matmul_bwd_kernel")
    assert any("HAS_SCALE=False" in r["variant"] and "DFlash2" in r["case"] for r in rows
               if r["kernel"] == "_rms_norm_bwd_kernel"), "the DFlash2 selector's norm backward was not compiled"
    spills = [f"{r['kernel']} {r['case']} {r['variant']} {r['config']} w{r['warps']}: {r['spill_store_bytes']} bytes"
              for r in rows if r["status"] != "ok"]
    assert not spills, "\n".join(spills)


# The kernels whose main loop carries an op's FLOPs: every config of their GPU autotune lists must compile
# to loops with asynchronous (pipelined) loads and a main loop whose every MMA is at least n64 wide (the
# narrowest, not only the widest: the dK/dV before issue 18 mixed m64n32 with m64n64), and at least one
# config of every kernel of the op must compile without spills. (Another op joins by listing its kernels.)
HOT_KERNELS = {"anchored_attention": ("_attn_fwd_kernel", "_attn_bwd_dq_kernel", "_attn_bwd_dkdv_kernel")}
MIN_MMA_N = 64


@pytest.fixture(scope="module")
def attention_rows(tmp_path_factory):
    """Every bf16 autotune config of the attention kernels at the reference shape (causal in block off)."""
    out = tmp_path_factory.mktemp("attention")
    args = ["--ops", "anchored_attention", "--dtypes", "bf16", "--shapes", "reference", "--configs", "all"]
    return run_compile_check(out, *args, "--cases", "causal=False")


def static_check_failures(rows, hot_kernels):
    """What breaks the rules above, one line per row or kernel (empty when none does)."""
    failures = []
    for r in rows:
        where = f"{r['kernel']} {r['variant']} {r['config']} w{r['warps']} s{r['stages']}"
        if r["kernel"] in hot_kernels and r["status"] in ("ok", "spills"):
            if r["mma_loops_without_async"] or not r["main_loop_async_copies"]:
                failures.append(
                    f"{where}: a loop with MMAs has no asynchronous load ({r['mma_loops_without_async']} such loops, "
                    f"{r['main_loop_async_copies']} async copies and {r['main_loop_sync_loads']} ld.global in the "
                    "main loop): keep the K/V/Q addresses free of branches so the pipeliner can issue cp.async"
                )
            if (r["narrowest_mma_n"] or 0) < MIN_MMA_N:
                failures.append(
                    f"{where}: an MMA of the main loop is n{r['narrowest_mma_n']} ({r['main_loop_mma']}), below "
                    f"n{MIN_MMA_N}: lay the tile so each warpgroup owns >= {MIN_MMA_N} columns"
                )
    for kernel in sorted({r["kernel"] for r in rows}):
        statuses = {r["status"] for r in rows if r["kernel"] == kernel}
        if "ok" not in statuses:
            failures.append(f"{kernel}: every bf16 config {sorted(statuses)}; at least one must compile without spills")
    return failures


def test_hot_attention_kernels_pipeline_loads_and_use_wide_mma(attention_rows):
    kernels = {r["kernel"] for r in attention_rows}
    assert set(HOT_KERNELS["anchored_attention"]) <= kernels, f"compiled {sorted(kernels)}"
    failures = static_check_failures(attention_rows, HOT_KERNELS["anchored_attention"])
    assert not failures, "\n".join(failures)


def test_static_check_flags_unpipelined_narrow_and_spilling_kernels(attention_rows):
    """The rules catch each regression they are there for, on rows edited to show it."""
    hot = HOT_KERNELS["anchored_attention"]
    fwd = [r for r in attention_rows if r["kernel"] == "_attn_fwd_kernel"]
    regressions = {
        "no asynchronous load": [dict(fwd[0], mma_loops_without_async=1)],
        "below n64": [dict(fwd[0], narrowest_mma_n=32, main_loop_mma="wgmma m64n32k16 x16, wgmma m64n64k16 x8")],
        "at least one must compile without spills": [dict(r, status="spills") for r in fwd],
    }
    for message, edited in regressions.items():
        failures = static_check_failures(edited, hot)
        assert any(message in f for f in failures), (message, failures)



@pytest.mark.parametrize("version", ["3.6.0", "3.9.0"])
def test_static_check_flags_the_attention_kernels_before_issue_18(version):
    """On the committed compile_check report of the kernels before issue 18 (real rows, no compile): their
    forward and dQ loops have no asynchronous load, and every dK/dV config has an MMA below n64 or spills."""
    path = os.path.join(REPO, "bench", "results", "compile_check_attention_before", f"compile_check_{version}.json")
    with open(path) as f:
        rows = [r for r in json.load(f)["rows"] if r["dtype"] == "bf16" and " reference causal=False" in r["case"]]
    failures = static_check_failures(rows, HOT_KERNELS["anchored_attention"])
    for kernel in ("_attn_fwd_kernel", "_attn_bwd_dq_kernel"):
        assert any(f.startswith(kernel) and "no asynchronous load" in f for f in failures), (kernel, failures)
    dkdv = [r for r in rows if r["kernel"] == "_attn_bwd_dkdv_kernel"]
    narrow = [f for f in failures if f.startswith("_attn_bwd_dkdv_kernel") and "below n64" in f]
    wide_but_spilling = [r for r in dkdv if r["narrowest_mma_n"] >= MIN_MMA_N and r["status"] == "spills"]
    assert dkdv and len(narrow) + len(wide_but_spilling) == len(dkdv), failures

# A PTX excerpt in the shape llc writes it: an outer loop (BB0_2) around an inner loop (BB0_4) that holds
# the MMAs and the pipelined loads, a block reached by falling through that belongs to the inner loop,
# and MMAs after the loops.
PTX = """
// %bb.0:
\tld.global.v4.b32 \t{%r1, %r2, %r3, %r4}, [%rd1];
$L__BB0_2:                              // =>This Loop Header: Depth=1
                                        //     Child Loop BB0_4 Depth 2
\tld.global.b32 \t%r5, [%rd2];
$L__BB0_4:                              // %.lr.ph
                                        //   Parent Loop BB0_2 Depth=1
                                        // =>  This Inner Loop Header: Depth=2
\tcp.async.cg.shared.global [ %r6 + 0 ], [ %rd3 + 0 ], 0x10, %r7;
\tcp.async.commit_group;
\twgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%r8}, %rd4, %rd5, 1;
\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r8}, %rd4, %rd5, 1;
// %bb.5:                               //   in Loop: Header=BB0_4 Depth=2
\tcp.async.wait_group \t0;
\tld.global.b32 \t%r9, [%rd6];
\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r8}, %rd4, %rd5, 1;
\t@%p1 bra \t$L__BB0_4;
$L__BB0_6:                              //   in Loop: Header=BB0_2 Depth=1
\t@%p2 bra \t$L__BB0_2;
// %bb.7:
\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%r10}, {%r11}, {%r12}, {%r13};
\tret;
"""


def test_static_facts_read_the_main_loop_of_ptx():
    facts = static_facts.static_facts(PTX, "ptxas info : Potential Performance Loss: wgmma serialized\n")
    assert facts["loops"] == 2
    assert facts["mma_loops_without_async"] == 0
    assert facts["main_loop_async_copies"] == 1  # commit_group and wait_group are not copies
    assert facts["main_loop_sync_loads"] == 1
    assert facts["main_loop_mma"] == "wgmma m64n128k16 x1, wgmma m64n64k16 x2"
    assert facts["widest_mma_n"] == 128 and facts["narrowest_mma_n"] == 64
    assert facts["other_mma"] == "mma m16n8k16 x1"
    assert facts["ptxas_remarks"] == "wgmma serialized"
    unpipelined = static_facts.static_facts(PTX.replace("cp.async.cg.shared.global", "ld.global.v4.b32"))
    assert unpipelined["mma_loops_without_async"] == 1 and unpipelined["main_loop_async_copies"] == 0


def test_occupancy_counts_programs_per_sm_and_waves():
    # 255 registers x 256 threads fill the register file: one program per SM.
    assert static_facts.occupancy(90, 255, 8, 98304, 2048) == {"per_sm": 1, "waves": round(2048 / 132, 2)}
    # 128 registers x 128 threads fit four times; 60 KB of shared memory (+1 KB reserved) only three times.
    assert static_facts.occupancy(90, 128, 4, 60 * 1024, 396) == {"per_sm": 3, "waves": 1.0}


def test_compile_diff_names_every_changed_fact_and_row():
    """bench/compile_diff.py, which a behaviour-preserving kernel change is checked with, on the committed
    attention reports before and after issue 18 (no compile): it names the rows only one report has and each
    fact that changed, and nothing for a report against itself."""
    results = os.path.join(REPO, "bench", "results")
    before = compile_diff.read_rows(os.path.join(results, "compile_check_attention_before", "compile_check_3.9.0.json"))
    after = compile_diff.read_rows(os.path.join(results, "compile_check_attention", "compile_check_3.9.0.json"))
    assert compile_diff.differences(after, after) == []
    lines = compile_diff.differences(before, after)
    # Issue 18 replaced the preprocess kernel by the block pass (and changed every variant or config).
    assert any(line.startswith("only before: anchored_attention | _bwd_preprocess_kernel") for line in lines), lines
    assert any(line.startswith("only after: anchored_attention | _attn_bwd_block_kernel") for line in lines), lines
    key = next(iter(after))
    edited = {**after, key: dict(after[key], n_regs=after[key]["n_regs"] + 1)}
    assert compile_diff.differences(after, edited) == [
        f"{' | '.join(map(str, key[1:]))}: n_regs {after[key]['n_regs']} -> {after[key]['n_regs'] + 1}"
    ]
