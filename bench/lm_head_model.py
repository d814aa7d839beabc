"""A design model of the fused lm_head loss (kernels/lm_head_loss.py) on one H200, computed on a CPU.

    python bench/lm_head_model.py                 # reference shapes: N = 8192 and 32768, every loss kind
    python bench/lm_head_model.py --small         # small shapes, what tests/test_lm_head_model.py runs
    python bench/lm_head_model.py --rows 1 --cases 'DSpark|^kl$'   # N = 8192 only: kl and DSpark (docs/dspark.md)
    python bench/lm_head_model.py --rows 1 --cases 'DFlash2|^kl$'  # kl and DFlash2 (docs/dflash2.md)
    python bench/lm_head_model.py --medium --cases 'DFlash2|^kl$'  # small rows, V = 65536: DFlash2's CI test
    python bench/lm_head_model.py --rows 1 --cases 'LiLiCorr|^kl$' # kl and LiLiCorr (docs/lilicorr.md)
    .venv36/bin/python bench/lm_head_model.py     # the same under Triton 3.6

Nothing here is a measurement. The model runs the kernel module's own host code on CPU tensors with every
Triton launch intercepted by bench/compile_check.py's recorder: each launch compiles, for every config of
its autotune list, for sm_90 with the triton wheel's ptxas (registers, spills, shared memory come from
that code) and nothing runs. Each recorded launch becomes

  * FLOPs of its tensor-core work, summed per call in GEMM units of 2 N V H;
  * programs, resident programs per SM (the least of: shared memory, registers x threads, 64 warps,
    32 blocks) and waves on 132 SMs;
  * HBM bytes from the wave model: programs run in launch order, one wave of resident programs at a
    time; co-resident programs advance through their steps together, so an operand tile that several
    of them use in the same step is read once; a tile used again in the next step is still in L2 when
    the distinct tiles of a step fit in L2 (50 MB); outputs are written once. The tile order of a
    kernel is what decides its reuse here;
  * a lower-bound time: max(FLOPs / 790 TFLOP/s stretched to whole waves, HBM bytes / 4.3 TB/s).

Torch operations between launches are counted the same way from their tensors (bytes read and written,
once each) and the peak memory of the call is the most bytes its own allocations hold at once, leaving
out the tensors it returns. Per case, the sum of the launch times is compared with the GEMM floor of
PERF.md: 3 units for `kl` and teacher `ce`, 2 for `ce` with stored labels, `ce_data` and `kl_topk`; the other
dense kinds (`tv`, `lk`, `lk_hybrid`, `rkl`, `jsd`) need the teacher's logits as `kl` does: 3 units, the same
GEMMs as `kl` (their extra row pass over the chunk's stored logits is HBM traffic, no GEMM);
`kl(DSpark)` is `kl` with DSpark's Markov bias of rank r = H / 16 (256 at H = 4096) folded into the GEMM,
with gradients for e and W2: 3 + 3 r / H units.
`kl(DFlash2)` is `kl` with DFlash2's selector (spec.md §9, r = H / 16, K = 16) as the drafter runs it: the lm_head
pass with `topk=K` (each row's unary top-K and their logits from its chunk, only the K tiles with the largest maxima
read), the selector's input norm(h) by the Triton RMSNorm, then in torch its K-way loss over the candidates (unary
logits from the pass, the transition) and the backward of that loss to h and the selector's weights (the unary part
by one embedding_bag over the K lm_head rows; lm_head frozen): 3 units (the selector's own GEMMs are K / V and r / V
of a unit); its extra bytes are mostly torch ops (host_gb). Its convolutions are no part of the lm_head call:
`--cases` matching DFlash2 also writes <out>/lm_head_model_<triton>_dflash2_conv.{json,md}, the bytes one
sublayer's conv_in + conv_out (DFlash2's default taps 2, group 16) move forward and forward + backward, in [N, H]
passes, eager (counted from their torch ops like the host ops here) and with kernels/grouped_dynamic_conv.py (its
reads and writes from its tiles, the torch ops around it as the host ops here).
`kl(LiLiCorr)` is `kl` with LiLiCorr's lattice (docs/lilicorr.md; K = 8 candidates, a lattice of width H / 8, 2
layers, 4 heads, F = 64) as the drafter runs it: the lm_head pass with `topk=K` (the candidates, their logits and
each row's lse: no [N, V] tensor), norm(h) by the Triton RMSNorm, then in torch the lattice (the candidates' target
embeddings, the transformer over the (B - 1) K rows of each block, the factor heads), the lattice loss with its
distractor penalty (the teacher's logits at the candidates from their K lm_head rows) and its backward. The lattice's
own GEMMs are torch ops: their FLOPs are `host_units` (in GEMM units), their bytes `host_gb`.
Each launch takes the fastest config the model finds among those that compile without spills (the
autotuner's pick if the model were the GPU). Results: <out>/lm_head_model_<triton>.{json,md} (one row
per case) and <out>/lm_head_model_<triton>_kernels.{json,md} (one row per kernel and config).
"""
import argparse
import collections
import contextlib
import dataclasses
import importlib
import math
import os
import sys
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import write_results  # noqa: E402
from dflash_fast.data.batches import sample_anchors  # noqa: E402
from dflash_fast.drafter.losses import DPace, Markov, Teacher  # noqa: E402
from dflash_fast.drafter.targets import slot_targets, teacher_index  # noqa: E402
from dflash_fast.store.format import torch_dtype  # noqa: E402

H200 = dict(flops=790e12, hbm=4.3e12, sms=132, l2=50 << 20, smem_per_sm=233472, regs=65536, warps=64, blocks=32)
REFERENCE = dict(H=4096, V=151936, B=16, A=512, T=3072, docs=4, rows=(1, 4))
SMALL = dict(H=256, V=4099, B=16, A=32, T=192, docs=2, rows=(1,))
# SMALL's rows with a vocabulary of 512 whole tiles: DFlash2's top-K reads k / 512 of each row (k / 1187 at the
# reference), so its bytes against kl's are checked in CI where they mean what they mean at the reference.
MEDIUM = dict(SMALL, V=65536)
TOPK = 8
EPS = 1e-6
# The floor of PERF.md in GEMM units, per case.
DENSE = ("tv", "lk", "lk_hybrid", "rkl", "jsd")  # scored against the full teacher, as kl
MARKOV_RANK_PER_H = 1 / 16  # DSpark's default r = 256 at H = 4096
SELECTOR_TOP_K = 16  # DFlash2's default K (its rank: r = H / 16 as DSpark's, 256 at H = 4096)
CONV_TAPS, CONV_GROUP = 2, 16  # DFlash2's default convolution
LILICORR = dict(lilicorr_candidate_topk=8, lilicorr_num_heads=4, lilicorr_num_layers=2, lilicorr_mlp_ratio=2.0,
                lilicorr_factor_dim=64, lilicorr_vector_eps=1e-6, lilicorr_logit_scale=10.0)  # width: H / 8
FLOOR = {"kl": 3, "ce(teacher argmax)": 3, "ce(labels)": 2, "ce_data": 2, "kl_topk": 2, **{kind: 3 for kind in DENSE},
         "kl(DSpark)": 3 + 3 * MARKOV_RANK_PER_H, "kl(DFlash2)": 3, "kl(LiLiCorr)": 3}


# ---------------------------------------------------------------- what each launch costs


@dataclasses.dataclass
class Cost:
    """One launch: tensor-core FLOPs; programs in launch order, each a list of steps, each step the operand
    tiles it reads (keys of tile_bytes); bytes written; whether it is a GEMM (counted in units)."""

    flops: float
    programs: List[List[Tuple]]
    tile_bytes: Dict[Tuple, int]
    write_bytes: float
    gemm: bool = True


def _elt(t: torch.Tensor) -> int:
    return t.element_size()


def _rows(n: int, block: int) -> List[int]:
    """Row counts of the tiles of n rows in blocks of `block` (the last one partial)."""
    return [min(block, n - i) for i in range(0, n, block)]


def _stream_cost(programs: int, read: float, write: float) -> Cost:
    """A kernel that streams its operands once (norms, row reductions): no reuse to model."""
    per = read / max(programs, 1)
    return Cost(0.0, [[(("p", i),)] for i in range(programs)], {("p", i): per for i in range(programs)}, write, False)


def cost_rms_norm_fwd(a) -> Cost:
    n, h = a["N"], a["H"]
    return _stream_cost(triton.cdiv(n, a["BLOCK_N"]), n * h * _elt(a["x_ptr"]), n * h * _elt(a["y_ptr"]) + 4 * n)


def cost_rms_norm_bwd(a) -> Cost:
    n, h = a["N"], a["H"]
    programs = triton.cdiv(n, a["ROWS_PER_PROGRAM"])
    read = n * h * (_elt(a["x_ptr"]) + _elt(a["dy_ptr"])) + 8 * n
    return _stream_cost(programs, read, n * h * _elt(a["dx_ptr"]) + 4 * programs * h)


def _gemm_cost(order, n_m, n_n, m_rows, n_cols, k, a_elt, b_elt, out_bytes_per_elem, read_out=False) -> Cost:
    """A GEMM grid: program (i_m, i_n) in `order` reads A row tile i_m [m_rows[i_m], K] and B column tile
    i_n [K, n_cols[i_n]] in one step and writes its [m, n] output tile."""
    tiles = {("a", i): m_rows[i] * k * a_elt for i in range(n_m)}
    tiles.update({("b", j): n_cols[j] * k * b_elt for j in range(n_n)})
    programs = [[(("a", i), ("b", j))] for i, j in order]
    flops = 2.0 * sum(m_rows) * sum(n_cols) * k
    out = sum(m_rows) * sum(n_cols) * out_bytes_per_elem * (2 if read_out else 1)
    return Cost(flops, programs, tiles, out)


def tile_order(pid: int, n_m: int, n_n: int, group_m: int) -> Tuple[int, int]:
    """kernels/lm_head_loss.py `_tile_order`: the (row tile, column tile) of program pid."""
    width = group_m * n_n
    first_m = pid // width * group_m
    rows = min(n_m - first_m, group_m)
    return first_m + pid % width % rows, pid % width // rows


def grouped(n_m: int, n_n: int, group_m: int) -> List[Tuple[int, int]]:
    return [tile_order(pid, n_m, n_n, group_m) for pid in range(n_m * n_n)]


def cost_logits(a) -> Cost:
    """[M, H] @ W^T in the grouped order (with DSpark's bias: [M, H + R] against [W, W2], the first n_bias rows'
    e and every column tile's W2 read in the same step); writes the stored rows' fp32 logits and 3 partials per
    (row, tile)."""
    m, v, h, bm, bv = a["M"], a["V"], a["H"], a["BLOCK_M"], a["BLOCK_V"]
    k = h + (a["R"] if a["HAS_BIAS"] else 0)
    rows, cols = _rows(m, bm), _rows(v, bv)
    cost = _gemm_cost(grouped(len(rows), len(cols), a["group_m"]), len(rows), len(cols), rows, cols, k,
                      _elt(a["x_ptr"]), _elt(a["w_ptr"]), 0.0)
    if a["HAS_BIAS"]:  # rows past n_bias (teacher rows) load no e and multiply zeros: count only the drafter rows
        cost.flops -= 2.0 * (m - a["n_bias"]) * v * a["R"]
    cost.write_bytes = 4.0 * a["n_store"] * v + 12.0 * len(cols) * m
    return cost


def cost_softmax_merge(a) -> Cost:
    m, tiles = a["M"], a["NUM_TILES"]
    return _stream_cost(triton.cdiv(m, a["BLOCK_M"]), 12.0 * tiles * m, 12.0 * m)


def cost_dlogits(a) -> Cost:
    """One program per BLOCK_N rows: step 1 (kl_topk) reads the rows for the rest lse, or (a dense kind other than
    kl) the rows and their teacher rows for the row sums; the last step reads them (and each row's teacher row,
    shared by the drafter rows of a wave that point at it) and writes dlogits."""
    n, v, bn = a["N"], a["V"], a["BLOCK_N"]
    teacher = a["teacher_row_ptr"].values if a["HAS_TEACHER"] else None
    tiles, programs = {}, []
    for lo in range(0, n, bn):
        own = tuple(("s", i) for i in range(lo, min(lo + bn, n)))
        shared = tuple(("t", teacher[i]) for i in range(lo, min(lo + bn, n))) if teacher else ()
        steps = [own] if a["HAS_REST"] else []
        if a["HAS_TEACHER"] and a["KIND"] != "kl":
            steps.append(own + shared)
        if a["WRITE_GRAD"] or (a["HAS_TEACHER"] and a["KIND"] == "kl"):
            steps.append(own + shared)
        programs.append(steps)
        tiles.update({key: 4.0 * v for key in own + shared})
    write = n * v * _elt(a["dlogits_ptr"]) if a["WRITE_GRAD"] else 0.0
    return Cost(0.0, programs, tiles, write + 12.0 * n, gemm=False)


def cost_matmul(a) -> Cost:
    """c[M, NC] (+)= a[M, K] @ b[K, NC] in the grouped order. With HAS_MARKOV (DSpark) the programs of column tile
    i_c < cdiv(R, BLOCK_R) also read W2's columns [i_c BLOCK_R, +BLOCK_R) [K, BLOCK_R] and e's [BLOCK_M, BLOCK_R]
    in the same step as their a tile (no second read of a), write de and add into dW2 [K, R] fp32: one read and
    one write of dW2 per launch (a column tile's row tiles run in one wave here, so L2 merges their adds)."""
    m, nc, k, bm, bnc = a["M"], a["NC"], a["K"], a["BLOCK_M"], a["BLOCK_NC"]
    rows, cols = _rows(m, bm), _rows(nc, bnc)
    order = grouped(len(rows), len(cols), a["group_m"])
    cost = _gemm_cost(order, len(rows), len(cols), rows, cols, k, _elt(a["a_ptr"]), _elt(a["b_ptr"]),
                      _elt(a["c_ptr"]), read_out=bool(a["ACCUMULATE"]))
    if a["HAS_MARKOV"]:
        r, br = a["R"], a["BLOCK_R"]
        slices = _rows(r, br)
        for (i, j), program in zip(order, cost.programs):
            if j < len(slices):
                program[0] += (("w2", j), ("e", i, j))
                cost.flops += 2 * 2.0 * rows[i] * slices[j] * k  # de and dW2
        cost.tile_bytes.update({("w2", j): k * slices[j] * _elt(a["w2_ptr"]) for j in range(len(slices))})
        cost.tile_bytes.update({("e", i, j): rows[i] * slices[j] * _elt(a["e_ptr"])
                                for i in range(len(rows)) for j in range(len(slices))})
        cost.write_bytes += m * r * _elt(a["de_ptr"]) + 2 * 4.0 * k * r
    return cost


COSTS: Dict[str, Callable[[Dict], Cost]] = {
    "_rms_norm_fwd_kernel": cost_rms_norm_fwd,
    "_rms_norm_bwd_kernel": cost_rms_norm_bwd,
    "_logits_fwd_kernel": cost_logits,
    "_softmax_merge_fwd_kernel": cost_softmax_merge,
    "_dlogits_bwd_kernel": cost_dlogits,
    "_matmul_bwd_kernel": cost_matmul,
}


# ---------------------------------------------------------------- residency, waves, HBM, time


def programs_per_sm(row: Dict) -> int:
    """Resident programs per SM of one compiled kernel (0 when it cannot launch)."""
    warps, regs, smem = row["warps"], row["n_regs"], row["smem_bytes"]
    if regs is None or smem is None:
        return 0
    by_regs = H200["regs"] // (warps * math.ceil(regs * 32 / 256) * 256)
    by_smem = H200["smem_per_sm"] // (smem + 1024)  # the driver reserves 1 KB per block
    return max(0, min(by_regs, by_smem, H200["warps"] // warps, H200["blocks"]))


def hbm_bytes(cost: Cost, slots: int) -> float:
    """Operand bytes read from HBM under the wave model (module docstring), plus the writes."""
    total, prev, prev_fits = 0.0, set(), False
    for w in range(0, len(cost.programs), slots):
        wave = cost.programs[w : w + slots]
        for step in range(max(len(p) for p in wave)):
            tiles = {t for p in wave if step < len(p) for t in p[step]}
            fresh = tiles - prev if prev_fits else tiles
            total += sum(cost.tile_bytes[t] for t in fresh)
            prev, prev_fits = tiles, sum(cost.tile_bytes[t] for t in tiles) <= H200["l2"]
    return total + cost.write_bytes


def launch_time(cost: Cost, slots: int) -> Tuple[float, float, float]:
    """(seconds, HBM bytes, waves): max of the compute time stretched to whole waves and the HBM time."""
    programs = len(cost.programs)
    waves = programs / slots
    compute = cost.flops / H200["flops"] * (math.ceil(waves) / waves if cost.gemm and waves else 1.0)
    hbm = hbm_bytes(cost, slots)
    return max(compute, hbm / H200["hbm"]), hbm, waves


# ---------------------------------------------------------------- intercepting the host code


@dataclasses.dataclass
class TensorInfo:
    """What a cost needs of a tensor argument, without keeping the tensor alive (that would hide it from
    the memory count): shape, dtype and, for small integer tensors (row indices), the values."""

    shape: Tuple[int, ...]
    dtype: torch.dtype
    values: Optional[list] = None

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorInfo":
        small_int = not t.is_floating_point() and t.numel() <= 1 << 20
        return cls(tuple(t.shape), t.dtype, t.tolist() if small_int else None)

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


@dataclasses.dataclass
class Launch:
    kernel: str
    args: Dict[str, object]
    row: Dict[str, object]  # compile_check's row for the compiled kernel (registers, spills, smem)


class LaunchRecorder:
    """Wraps bench/compile_check.py's CompileRecorder: every launch (and every autotune config of it) is
    recorded with its bound arguments and the compile row of the kernel it would run."""

    def __init__(self, recorder):
        self.recorder = recorder
        self.launches: List[List[Launch]] = []  # one list per launch: one entry per autotune config
        self._autotuning = False
        self._rows: Dict[Tuple, Dict] = {}

    def install(self) -> None:
        self.recorder.install()
        me, jit_run, tuner_run = self, JITFunction.run, Autotuner.run

        def autotuner_run(tuner, *args, **kwargs):
            me.launches.append([])
            me._autotuning = True
            try:
                return tuner_run(tuner, *args, **kwargs)
            finally:
                me._autotuning = False

        def run(fn, *args, grid, warmup, **kwargs):
            before = len(me.recorder.records)
            out = jit_run(fn, *args, grid=grid, warmup=warmup, **kwargs)
            key = me._signature(fn, args, kwargs)
            if len(me.recorder.records) > before:
                me._rows[key] = me.recorder.records[-1]
            if key not in me._rows:  # binding failed before any compile: compile_check recorded the error
                return out
            bound = {k: TensorInfo.of(v) if isinstance(v, torch.Tensor) else v
                     for k, v in dict(zip(fn.arg_names, args), **kwargs).items()}
            if not me._autotuning:
                me.launches.append([])
            me.launches[-1].append(Launch(fn.__name__, bound, me._rows[key]))
            return out

        Autotuner.run = autotuner_run
        JITFunction.run = run

    @staticmethod
    def _signature(fn, args, kwargs) -> Tuple:
        """What decides Triton's compile cache here: dtypes, integers' divisibility by 16 and ==1, constexprs."""

        def spec(a):
            if isinstance(a, torch.Tensor):
                return str(a.dtype)
            if isinstance(a, bool) or not isinstance(a, int):
                return type(a).__name__
            return (a % 16 == 0, a == 1)

        return (fn, tuple(spec(a) for a in args), tuple(sorted((k, str(v)) for k, v in kwargs.items())))


class HostOps(TorchDispatchMode):
    """Counts the torch operations of a call and tracks its allocations.

    Every op's tensors are counted as HBM traffic (inputs read, outputs written, once each; views and
    factory ops cost nothing). `torch.empty`-like ops are zero-filled here: the intercepted kernels write
    nothing, and the host code must still see valid indices where a kernel would have written them.
    """

    VIEWS = {"view", "_unsafe_view", "slice", "select", "expand", "t", "transpose", "permute", "unsqueeze", "squeeze",
             "as_strided", "alias", "detach", "reshape", "unbind", "split", "chunk", "narrow", "diagonal", "unfold",
             "lift_fresh"}
    GATHERS = {"gather", "index", "index_select", "take", "take_along_dim"}
    BAGS = {"_embedding_bag", "_embedding_bag_forward_only", "embedding_bag"}  # sum K gathered rows per output row
    MATMULS = {"mm", "addmm", "bmm", "baddbmm"}  # 2 M N K FLOPs (the torch ops' GEMMs: `host_units`)
    FACTORIES = {"empty", "empty_like", "empty_strided", "new_empty", "zeros", "zeros_like", "new_zeros", "ones",
                 "ones_like", "full", "full_like", "new_full", "new_ones", "arange", "scalar_tensor", "zero_", "fill_"}

    def __init__(self):
        super().__init__()
        self.bytes = 0.0
        self.flops = 0.0
        self.live = 0
        self.events: List[Tuple[int, int]] = []  # (+bytes or -bytes, allocation id)
        self._refs: Dict[int, List[int]] = {}  # storage pointer -> [live tensors, bytes, allocation id]
        self._ids = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ARG002 (the protocol's signature)
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name.startswith("empty") or name == "new_empty":
            out.zero_()
        outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if name in self.MATMULS:
            a, b = [t for t in args if isinstance(t, torch.Tensor)][-2:]
            self.flops += 2.0 * a.numel() * b.shape[-1]
        elif "scaled_dot_product" in name:  # q k^T and p v of every head: 4 L L d (the backward's: twice that)
            q, k = args[0], args[1]
            self.flops += (8.0 if "backward" in name else 4.0) * q.numel() * k.shape[-2]
        if name not in self.VIEWS and name not in self.FACTORIES:
            ins = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if name in self.GATHERS:  # reads what it gathers (and the index), not its whole source
                ins = ins[1:]
                self.bytes += sum(t.numel() * t.element_size() for t in outs)
            elif name in self.BAGS:  # weight [V, H], ids [N, K]: reads N K rows of H (and ids, weights), writes [N, H]
                weight, ids = ins[0], ins[1]
                self.bytes += ids.numel() * weight.shape[1] * weight.element_size()
                ins = ins[1:]
                outs = outs[:1]
            self.bytes += sum(t.numel() * t.element_size() for t in ins + outs)
        for t in outs:
            self._track(t, view=name in self.VIEWS)
        return out

    def _track(self, t: torch.Tensor, view: bool) -> None:
        storage = t.untyped_storage()
        ptr, size = storage.data_ptr(), storage.nbytes()
        if size == 0:
            return
        ref = self._refs.get(ptr)
        if ref is None and view:  # a view of a tensor from before the call (an input)
            return
        if ref is None:
            self._ids += 1
            ref = self._refs[ptr] = [0, size, self._ids]
            self.events.append((size, self._ids))
        ref[0] += 1
        weakref.finalize(t, self._release, ptr)

    def _release(self, ptr: int) -> None:
        ref = self._refs[ptr]
        ref[0] -= 1
        if ref[0] == 0:
            del self._refs[ptr]
            self.events.append((-ref[1], ref[2]))

    def alive(self) -> set:
        """Allocation ids alive now (call it when the call returns: those are what it returned)."""
        return {ref[2] for ref in self._refs.values()}

    def peak_extra(self, kept: set) -> int:
        """The most bytes held at once by the allocations not in `kept` (the call's returned tensors)."""
        live = peak = 0
        for delta, ident in self.events:
            if ident not in kept:
                live += delta
                peak = max(peak, live)
        return peak


# ---------------------------------------------------------------- the cases


def training_rows(s: Dict, rows: int, seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Slot mask [N] and teacher index [N] (into rows*T positions) of `rows` synthetic training rows:
    `docs` documents of random lengths, a prompt (loss_mask 0) on each one's first eighth, A anchors
    sampled as dflash_fast.data.batches does (bench/bench_step.py's synthetic row)."""
    t = s["T"]
    gen = torch.Generator().manual_seed(seed)
    batch = collections.defaultdict(list)
    for _ in range(rows):
        cuts = torch.randperm(t - 1, generator=gen)[: s["docs"] - 1].add(1).sort().values
        starts = torch.cat([torch.zeros(1, dtype=torch.long), cuts])
        lengths = torch.diff(torch.cat([starts, torch.tensor([t])]))
        document_ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        loss_mask = (torch.arange(t) - starts[document_ids]) >= lengths[document_ids] // 8
        anchors, valid = sample_anchors(loss_mask, document_ids, s["A"], gen)
        for key, value in dict(loss_mask=loss_mask, document_ids=document_ids, anchors=anchors,
                               anchor_valid=valid, input_ids=torch.zeros(t, dtype=torch.long)).items():
            batch[key].append(value)
    tg = slot_targets({key: torch.stack(value) for key, value in batch.items()}, s["B"])
    return tg.slot_mask.flatten(), teacher_index(tg, t)


def case_call(mod, kind: str, s: Dict, rows: int, dtype, dpace: bool) -> Callable[[], object]:
    """The drafter's call of the loss for one case: h and norm_weight get gradients, lm_head is frozen;
    the full teacher is `last` of the rows' positions with the drafter's index into it."""
    n, h, v = rows * s["A"] * s["B"], s["H"], s["V"]
    mask, index = training_rows(s, rows)
    empty = lambda *shape, dt=dtype: torch.empty(shape, dtype=dt)  # noqa: E731
    if kind in ("kl", "kl(DSpark)", "kl(DFlash2)", "kl(LiLiCorr)", "ce(teacher argmax)") + DENSE:
        teacher = Teacher(last=empty(rows * s["T"], h), final_norm_weight=empty(h), index=index)
    elif kind in ("ce(labels)", "ce_data"):
        teacher = Teacher(labels=torch.zeros(n, dtype=torch.long))
    else:
        teacher = Teacher(topk_ids=torch.zeros(n, TOPK, dtype=torch.long), topk_logits=torch.zeros(n, TOPK),
                          topk_lse=torch.zeros(n))
    args = (empty(n, h), empty(h), empty(v, h), mask.float(), kind.split("(")[0], float(mask.sum()), EPS, teacher)
    weighting = DPace(0.5, s["B"]) if dpace else None
    markov, need = None, (True, True, False, False, False)
    if kind == "kl(DSpark)":  # e and W2 train: the drafter's case
        r = int(h * MARKOV_RANK_PER_H)
        markov, need = Markov(empty(n, r), empty(v, r)), (True, True, False, True, True)
    if kind == "kl(DFlash2)":
        return dflash2_call(mod, args, s, dtype)
    if kind == "kl(LiLiCorr)":
        return lilicorr_call(mod, args, s, dtype)
    return lambda: mod.lm_head_loss_forward(*args, weighting, markov, need_grads=need)


def dflash2_call(mod, args, s: Dict, dtype) -> Callable[[], object]:
    """DFlash2's head as DFlashDrafter.loss runs it on the Triton path: the fused pass with topk = K, the selector's
    input norm(h) by the Triton RMSNorm (ops.rms_norm), then the selector's loss (dflash2.selector_loss: candidates,
    their unary logits from the pass, the transition, the K-way CE) and its backward, in torch."""
    from dflash_fast.kernels import _common  # imported for the GPU by compile_check.import_kernels_for_gpu

    from dflash_fast.drafter.dflash2 import CandidateSelector, selector_loss

    h, norm_weight, lm_head, weights, kind, normalizer, eps, teacher = args
    n = h.shape[0]
    selector = CandidateSelector(s["V"], s["H"], int(s["H"] * MARKOV_RANK_PER_H), SELECTOR_TOP_K).to(dtype)
    x = h.clone().requires_grad_(True)
    prev = torch.zeros(n, dtype=torch.long)

    def call():
        out = mod.lm_head_loss_forward(x.detach(), norm_weight, lm_head, weights, kind, normalizer, eps, teacher,
                                       need_grads=(True, True, False, False, False), topk=SELECTOR_TOP_K)
        teacher_argmax, topk_ids, topk_logits = out[3], out[5], out[6]
        hidden = _common.rms_norm(x, norm_weight, eps)
        sel = selector_loss(selector, hidden, lm_head, prev, topk_ids, teacher_argmax, weights,
                            torch.tensor(normalizer), None, topk_logits)
        sel.loss.backward()
        return out, sel.draft

    return call


def lilicorr_call(mod, args, s: Dict, dtype) -> Callable[[], object]:
    """LiLiCorr's lattice as DFlashDrafter.forward runs it (lilicorr.lattice_terms) on the Triton path: the fused pass
    with topk = K (candidates, logits, lse), norm(h) by the Triton RMSNorm, the lattice head, the lattice loss with
    its penalty, and the backward of that loss, in torch."""
    from types import SimpleNamespace

    from dflash_fast.kernels import _common  # imported for the GPU by compile_check.import_kernels_for_gpu

    from dflash_fast.drafter.lilicorr import LatticeWeights, LiLiCorrHead, lattice_loss, teacher_candidate_logits

    h, norm_weight, lm_head, weights, kind, normalizer, eps, teacher = args
    b, k, width = s["B"], LILICORR["lilicorr_candidate_topk"], s["H"]
    cfg = SimpleNamespace(hidden_size=width, block_size=b, rms_norm_eps=eps, lilicorr_hidden_size=width // 8,
                          **LILICORR)
    head = LiLiCorrHead(cfg).to(dtype)
    embed = torch.randn(lm_head.shape, dtype=dtype)
    x = h.clone().requires_grad_(True)
    blocks = h.shape[0] // b

    def call():
        out = mod.lm_head_loss_forward(x.detach(), norm_weight, lm_head, weights, kind, normalizer, eps, teacher,
                                       need_grads=(True, True, False, False, False), topk=k)
        teacher_argmax, topk_ids, topk_logits, topk_lse = out[3], out[5], out[6], out[7]
        hidden = _common.rms_norm(x, norm_weight, eps).view(blocks, b, -1)[:, 1:]
        ids = topk_ids.view(blocks, b, k)[:, 1:]
        log_probs = (topk_logits - topk_lse[:, None]).view(blocks, b, k)[:, 1:]
        anchor = hidden[:, 0].detach()  # a [H] row per block, as the context's is
        start, pair = head.log_factors(*head.scores(embed[ids], log_probs, hidden, anchor,
                                                    torch.ones(blocks, dtype=torch.bool)))
        rows = teacher.last[teacher.index].view(blocks, b, -1)[:, 1:].reshape(-1, width)
        t = teacher_candidate_logits(rows, teacher.final_norm_weight, eps, lm_head, ids.reshape(-1, k))
        terms = lattice_loss(start, pair, ids, teacher_argmax.view(blocks, b)[:, 1:],
                             torch.ones(blocks, dtype=torch.bool), t.view(blocks, b - 1, k), LatticeWeights())
        terms.loss.backward()
        return out, terms.walk

    return call


@contextlib.contextmanager
def conv_kernels_priced(counter: List[float]):
    """Run DFlash2's convolutions on the Triton path (kernels/grouped_dynamic_conv.py's autograd Functions and the
    torch ops around their launches, as the drafter runs them) with the two launches priced, not run: its
    conv_forward and conv_backward replaced by stand-ins that add the kernels' HBM bytes to counter[0] and return
    unwritten tensors of the right shapes (factories: HostOps counts nothing for them). The bytes follow the
    kernel's tiles (`_tiles`): x (and dy) read once plus the T - 1 rows above (below) each row tile, delta
    [N, T, G] and base read once, the residual read once where conv_out adds it, y (dx, d delta, the fp32 d base
    partials of each row tile) written once; the host's sum of the partials is a torch op, which HostOps counts."""
    from dflash_fast.drafter import ops

    kernel = importlib.import_module("dflash_fast.kernels.grouped_dynamic_conv")  # the module the ops switch runs

    def streams(x, delta, base, group_size):
        h = x.shape[-1]
        n = x.numel() // h
        taps, groups = base.shape[0], h // group_size
        tiles = triton.cdiv(n, kernel._tiles(group_size)[0])
        rows = (n + (taps - 1) * tiles) * h * _elt(x)  # one [N, H] pass plus the halo rows
        coefficients = (n + (taps - 1) * tiles) * taps * groups * _elt(delta) + base.numel() * _elt(base)
        return tiles, rows, coefficients

    def conv_forward(x, delta, base, block_size, group_size, residual=None):  # noqa: ARG001 (the kernel's signature)
        _, rows, coefficients = streams(x, delta, base, group_size)
        counter[0] += rows + coefficients + x.numel() * _elt(x) + (0 if residual is None else x.numel() * _elt(x))
        return torch.empty_like(x)

    def conv_backward(dy, x, delta, base, block_size, group_size, d_delta=None):  # noqa: ARG001 (the kernel's)
        tiles, rows, coefficients = streams(x, delta, base, group_size)
        if d_delta is None:
            d_delta = torch.empty(delta.shape, dtype=delta.dtype)
        partials = torch.empty((tiles, *base.shape), dtype=torch.float32)
        counter[0] += 2 * rows + coefficients + x.numel() * _elt(x) + d_delta.numel() * _elt(d_delta) \
            + partials.numel() * 4
        return torch.empty_like(x), d_delta, partials.sum(0).to(base.dtype)

    saved = kernel.conv_forward, kernel.conv_backward
    kernel.conv_forward, kernel.conv_backward = conv_forward, conv_backward
    try:
        with ops.backend("grouped_dynamic_conv=triton"):
            yield
    finally:
        kernel.conv_forward, kernel.conv_backward = saved


def conv_rows(s: Dict, rows: int, dtype) -> List[Dict]:
    """DFlash2's convolutions around one sublayer (conv_in before it, conv_out after it with the residual add inside
    it, one kernel projection), at N = rows x A x B slots: the bytes they move forward and forward + backward, in
    [N, H] passes of the activation dtype (the projection's GEMM and its weight gradient included), for each backend
    of the op `grouped_dynamic_conv`: eager (its torch ops, HostOps: every op's inputs read and outputs written once)
    and triton (the kernels' bytes from `conv_kernels_priced`, the torch ops around it by HostOps).

    What the convolutions cost is what they add to a DFlash sublayer, whose residual add (`residual + fn(y)`) already
    reads 2 and writes 1 [N, H] forward and hands dy on backward: `dflash_passes` is that add counted the same way,
    `extra_passes` = `nh_passes` - `dflash_passes`, and `kernel_extra_passes` the conv kernels' bytes less the add
    (conv_out reads the residual and writes the sum in the add's place). The issue's budget, on the extra: one [N, H]
    read and write per convolution, 4 passes for the two of a sublayer forward (8 with their backward)."""
    from dflash_fast.drafter import conv, ops

    n, hid = rows * s["A"] * s["B"], s["H"]
    conv = conv.DynamicConv(hid, s["B"], CONV_TAPS, CONV_GROUP).to(dtype)
    x = torch.zeros(1, n, hid, dtype=dtype, requires_grad=True)
    residual = torch.zeros(1, n, hid, dtype=dtype, requires_grad=True)
    passes = n * hid * torch.empty((), dtype=dtype).element_size()
    inputs = (x, residual, *conv.parameters())

    def counted(sublayer: Callable[[], torch.Tensor], backward: bool) -> float:
        """Bytes of sublayer() (and of its gradients for x, the residual and the conv's weights) by HostOps."""
        with HostOps() as host:
            z = sublayer()
            if backward:  # autograd.grad: the gradients handed over as they are, no leaf .grad accumulated
                torch.autograd.grad(z, inputs, torch.zeros_like(z), allow_unused=True)
        return host.bytes

    labels = (("forward", False), ("forward + backward", True))
    dflash_bytes = {label: counted(lambda: residual + x, backward) for label, backward in labels}  # a DFlash add
    out = []
    for backend in ("eager", "triton"):
        for label, backward in labels:
            kernel = [0.0]
            priced = conv_kernels_priced(kernel) if backend == "triton" else ops.backend("grouped_dynamic_conv=eager")
            with priced:  # the sublayer between conv_in and conv_out: the identity here (no op of its own)
                moved = counted(lambda: conv.finish(*conv.prepare(x), residual), backward) + kernel[0]
            dflash = dflash_bytes[label]
            extra = moved - dflash
            out.append(dict(case=f"conv_in + conv_out, {label}", backend=backend, N=n, H=hid, taps=CONV_TAPS,
                            group=CONV_GROUP, gb=round(moved / 1e9, 3), bytes=int(moved),
                            kernel_bytes=int(kernel[0]), nh_passes=round(moved / passes, 2),
                            dflash_passes=round(dflash / passes, 2), extra_passes=round(extra / passes, 2),
                            kernel_extra_passes=round((kernel[0] - dflash) / passes, 2) if kernel[0] else None,
                            budget_passes=8 if backward else 4, extra_gb=round(extra / 1e9, 3),
                            extra_ms=round(extra / H200["hbm"] * 1e3, 3)))
    return out


CASES = [("kl", False), ("ce(teacher argmax)", False), ("ce(labels)", False), ("ce_data", False), ("kl_topk", False),
         ("kl", True), ("kl(DSpark)", False), ("kl(DFlash2)", False), ("kl(LiLiCorr)", False)] + \
    [(kind, False) for kind in DENSE]


def model_case(mod, recorder: LaunchRecorder, kind, dpace, s, rows, dtype, kernel_rows: List[Dict]) -> Dict:
    n = rows * s["A"] * s["B"]
    unit = 2.0 * n * s["V"] * s["H"]
    call = case_call(mod, kind, s, rows, dtype, dpace)
    first = len(recorder.launches)
    host = HostOps()
    with host:
        out = call()
        returned = host.alive()
    del out
    totals = collections.Counter()
    per_kernel: Dict[Tuple, Dict] = {}
    spills_default = []
    for options in recorder.launches[first:]:
        modelled = []
        for launch in options:
            slots = programs_per_sm(launch.row) * H200["sms"]
            cost = COSTS[launch.kernel](launch.args)
            if slots == 0 or launch.row["status"] not in ("ok", "spills"):
                continue
            seconds, hbm, waves = launch_time(cost, slots)
            modelled.append((launch, cost, slots, seconds, hbm, waves))
            key = (launch.kernel, launch.row["variant"], launch.row["config"], launch.row["warps"],
                   launch.row["stages"])
            agg = per_kernel.setdefault(key, dict(launches=0, programs=0, waves=0.0, flops=0.0, hbm=0.0, s=0.0,
                                                  row=launch.row, slots=slots))
            agg["launches"] += 1
            agg["programs"] += len(cost.programs)
            agg["waves"] += waves
            agg["flops"] += cost.flops
            agg["hbm"] += hbm
            agg["s"] += seconds
        spills_default += [m[0].row for m in modelled if m[0].row["status"] == "spills"]
        fits = [m for m in modelled if m[0].row["status"] == "ok"] or modelled
        launch, cost, slots, seconds, hbm, waves = min(fits, key=lambda m: m[3])
        totals["s"] += seconds
        totals["hbm"] += hbm
        totals["flops" if cost.gemm else "other_flops"] += cost.flops
        totals["launches"] += 1
        chosen = (launch.kernel, launch.row["variant"], launch.row["config"], launch.row["warps"], launch.row["stages"])
        per_kernel[chosen]["chosen"] = per_kernel[chosen].get("chosen", 0) + 1
    host_s = host.bytes / H200["hbm"]
    label = f"{kind}, D-PACE" if dpace else kind
    for (kernel, variant, config, warps, stages), agg in per_kernel.items():
        row = agg["row"]
        kernel_rows.append(
            dict(
                case=label,
                N=n,
                kernel=kernel,
                variant=variant,
                config=f"{config} w{warps} s{stages}",
                chosen=agg.get("chosen", 0),
                launches=agg["launches"],
                programs=agg["programs"],
                per_sm=agg["slots"] // H200["sms"],
                waves=round(agg["waves"], 2),
                n_regs=row["n_regs"],
                spill_bytes=row["spill_store_bytes"],
                smem_kb=round(row["smem_bytes"] / 1024, 1),
                units=round(agg["flops"] / unit, 3),
                hbm_gb=round(agg["hbm"] / 1e9, 2),
                ms=round(agg["s"] * 1e3, 3),
            )
        )
    seconds = totals["s"] + host_s
    floor_s = FLOOR[kind] * unit / H200["flops"]
    return dict(
        case=label,
        N=n,
        units=round(totals["flops"] / unit, 3),
        floor_units=FLOOR[kind],
        launches=totals["launches"],
        hbm_gb=round(totals["hbm"] / 1e9, 2),
        hbm_bytes=int(totals["hbm"]),
        host_gb=round(host.bytes / 1e9, 3),
        host_bytes=int(host.bytes),
        host_units=round(host.flops / unit, 4),
        host_gemm_ms=round(host.flops / H200["flops"] * 1e3, 3),  # not in `ms` (bytes only for the torch ops)
        ms=round(seconds * 1e3, 2),
        floor_ms=round(floor_s * 1e3, 2),
        vs_floor=round(seconds / floor_s, 3),
        peak_extra_gb=round(host.peak_extra(returned) / 1e9, 2),
        peak_extra_bytes=host.peak_extra(returned),
        spilling_configs=len({(r["kernel"], r["variant"], r["config"]) for r in spills_default}),
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join("bench", "results"), help="results folder (default bench/results)")
    p.add_argument("--small", action="store_true", help="small shapes (the CI test): H=256, V=4099, A=32, T=192")
    p.add_argument("--medium", action="store_true", help="the small shapes with V=65536 (DFlash2's CI test)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--cases", default="", help="regex over the case labels ('kl', 'ce(labels)', 'kl, D-PACE', ...)")
    p.add_argument("--rows", type=int, nargs="+", help="training rows per call, N = rows x A x B (default: reference "
                   "1 4, small 1)")
    return p.parse_args(argv)


def main(argv=None) -> List[Dict]:
    import re

    from bench import compile_check as cc  # refuses TRITON_INTERPRET=1; compiles into an empty Triton cache

    args = parse_args(argv)
    torch.set_num_threads(1)
    kernel_sha256 = cc._sha256(os.path.join(cc.KERNELS_DIR, "lm_head_loss.py"))  # the source the rows belong to
    s = MEDIUM if args.medium else SMALL if args.small else REFERENCE
    (mod,) = [m for m in cc.import_kernels_for_gpu(H200["sms"]) if m.__name__.endswith("lm_head_loss")]
    recorder = LaunchRecorder(cc.CompileRecorder(90, "all"))
    recorder.install()
    dtype = torch_dtype(args.dtype)
    rows, kernel_rows = [], []
    try:
        for r in args.rows or s["rows"]:
            for kind, dpace in CASES:
                if re.search(args.cases, f"{kind}, D-PACE" if dpace else kind):
                    recorder.recorder.case, recorder.recorder.dtype = f"lm_head_loss {args.dtype} {kind}", args.dtype
                    rows.append(model_case(mod, recorder, kind, dpace, s, r, dtype, kernel_rows))
                    print(rows[-1], flush=True)
    finally:
        import shutil

        shutil.rmtree(cc._CACHE_DIR, ignore_errors=True)
    shape = {k: s[k] for k in ("H", "V", "B", "A", "T", "docs")}
    meta = dict(
        shapes=f"{shape}, N = rows x A x B for rows in {tuple(args.rows or s['rows'])}, {args.dtype}; lm_head frozen "
               "(the drafter's case)",
        gpu="H200 as PERF.md: 790 TFLOP/s dense bf16 (measured), 4.3 TB/s, 132 SMs, 50 MB L2, 228 KB smem per SM",
        unit="one GEMM unit = 2 N V H FLOPs; floor: 3 units for kl, the other dense kinds and teacher ce, 2 for the "
             "others",
        ms="sum over launches of max(FLOPs at 790 TFLOP/s over whole waves, HBM bytes at 4.3 TB/s), plus host ops",
        peak_extra_gb="most bytes the call's own allocations hold at once, its returned tensors left out",
        kernel_sha256=kernel_sha256,
        ptxas=str(cc.get_ptxas(90).path),
    )
    name = f"lm_head_model_{triton.__version__}" + ("_medium" if args.medium else "_small" if args.small else "")
    print(write_results(name, rows, args.out, meta=meta))
    write_results(name + "_kernels", kernel_rows, args.out, meta=meta)
    if re.search(args.cases, "kl(DFlash2)"):
        conv = [row for r in args.rows or s["rows"] for row in conv_rows(s, r, dtype)]
        print(write_results(name + "_dflash2_conv", conv, args.out, meta=dict(
            shapes=meta["shapes"], dtype=args.dtype,
            budget="one extra [N, H] read and write per convolution (issue 39)",
            counted="DynamicConv.prepare + finish (dflash_fast/drafter/dflash2.py), the sublayer between them left "
                    "out: eager = its torch ops; triton = kernels/grouped_dynamic_conv.py's reads and writes from its "
                    "tiles (kernel_bytes) + the torch ops around it (the projection, its gradient, the d base sum); "
                    "not a measurement")))
    return rows


if __name__ == "__main__":
    main()
