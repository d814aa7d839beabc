"""Design model of the anchored attention kernels on an H200, from compile_check's rows: no GPU, no timing.

    python bench/attention_model.py                     # after: bench/results/compile_check_attention/
    python bench/attention_model.py --before DIR        # also the kernels before issue 18 (their report in DIR)

For every pass, every bf16 autotune config that compiled for sm_90 (compile_check's rows, reference shape,
causal in block off) and every packed row below, the model walks the programs of the launch in launch
order with the tiles each one visits, exactly as the kernel walks them, and prices them:

  tile time     FLOPs of one visited tile / (PEAK / SMS / per_sm) / MMA efficiency of the config's main
                loop, plus the load latency an iteration does not hide: a main loop without asynchronous
                copies waits LOAD_LATENCY_US every iteration, a pipelined one max(0, LOAD_LATENCY_US -
                (stages - 1) x compute of an iteration)
  program       its tiles, its own-block packs (batched mma.sync dots) and one LOAD_LATENCY_US to start
  pass          programs assigned in launch order to the first free of SMS x per_sm slots (per_sm:
                compile_check's residency from registers and shared memory): the makespan
  memory passes the preprocess / block pass move bytes at COPY_TB_S (they have no tile loop)
  floor         the visited-tile FLOPs of the pass (incl. own blocks) at PEAK
  config        the one with the smallest modelled time, as the autotuner would pick

MMA efficiency: wgmma m64nNk16 runs at full rate for N >= 64 and at N / 64 x 4/3 below (n32: 2/3, the
issue's figure), mma.sync at MMA_SYNC_EFFICIENCY; a main loop with several shapes runs at their
FLOP-weighted harmonic mean (per-instruction FLOPs from the PTX counts). These are assumptions with
the figures from PERF.md (790 TFLOP/s measured, 4.3 TB/s copy); they rank designs, they measure nothing.

Rows: the reference drafter (Hq = 32, Hkv = 8, D = 128, B = 16, A = 512 sorted anchors), T = 3072 and
8192, one document per row (the longest contexts) and bench_attention's random documents.
"""

import argparse
import heapq
import json
import math
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflash_fast.kernels.anchored_attention import (  # noqa: E402
    anchors_per_tile,
    context_ranges,
    pack_rows,
    visibility_plan,
)

from bench.harness import write_results  # noqa: E402

PEAK = 790e12  # dense bf16 matmul, measured on one H200 (PERF.md)
SMS = 132
COPY_TB_S = 4.3  # device-to-device copy, measured (PERF.md)
LOAD_LATENCY_US = 0.3  # ~500 cycles of a global load at 1.75 GHz: the latency a non-pipelined iteration waits
MMA_SYNC_EFFICIENCY = 0.5
SHAPE = dict(Hq=32, Hkv=8, D=128, B=16, A=512)
SEQ_LENS = (3072, 8192)
DTYPE_BYTES = 2

# Kernel names, per design, by pass.
AFTER = {
    "forward": "_attn_fwd_kernel",
    "block pass": "_attn_bwd_block_kernel",
    "dQ": "_attn_bwd_dq_kernel",
    "context dK/dV": "_attn_bwd_dkdv_kernel",
}
BEFORE = {
    "forward": "_attn_fwd_kernel",
    "preprocess": "_bwd_preprocess_kernel",
    "dQ": "_attn_bwd_dq_kernel",
    "context dK/dV": "_attn_bwd_dkdv_kernel IS_CTX=True",
    "block dK/dV": "_attn_bwd_dkdv_kernel IS_CTX=False",
}
MMAS = {"forward": 2, "dQ": 3, "context dK/dV": 4, "block dK/dV": 4}


def make_row(t: int, n_anchor: int, seed: int = 0, doc_lengths: Optional[Sequence[int]] = None):
    """One packed row: document_ids [1, T] (doc_lengths, or random lengths of T/8 .. T/2), sorted anchors
    [1, A] sampled uniformly without replacement (never a document's last token), their validity [1, A]."""
    gen = torch.Generator().manual_seed(seed)
    lengths = list(doc_lengths or [])
    while sum(lengths) < t:
        lengths.append(int(torch.randint(t // 8, t // 2 + 1, (1,), generator=gen)))
    lengths[-1] -= sum(lengths) - t
    docs = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    not_last = torch.ones(t, dtype=torch.bool)
    not_last[:-1] = docs[1:] == docs[:-1]
    not_last[-1] = False
    candidates = not_last.nonzero()[:, 0]
    anchors = candidates[torch.randperm(len(candidates), generator=gen)[:n_anchor]].sort().values
    return docs[None], anchors[None], torch.ones_like(anchors, dtype=torch.bool)[None]


def visible_pairs(plan, block_size: int, causal: bool) -> int:
    """Visible (query, key) pairs of one head, summed over rows."""
    ctx = (plan.hi - plan.lo).long() * plan.valid
    blk = block_size * (block_size + 1) // 2 if causal else block_size * block_size
    return int(ctx.sum()) * block_size + int(plan.valid.sum()) * blk


def mma_efficiency(main_loop_mma: str) -> float:
    """FLOP-weighted harmonic mean of the rates of the main loop's MMA instructions ('wgmma m64n64k16 x8, ...')."""
    flops, time = 0.0, 0.0
    for part in main_loop_mma.split(", "):
        if part == "none":
            continue
        name, count = part.rsplit(" x", 1)
        kind, mnk = name.split()
        m, rest = mnk[1:].split("n")
        n, k = rest.split("k")
        f = 2 * int(m) * int(n) * int(k) * int(count)
        rate = min(1.0, int(n) / 64 * 4 / 3) if kind == "wgmma" else MMA_SYNC_EFFICIENCY
        flops, time = flops + f, time + f / rate
    return flops / time if time else MMA_SYNC_EFFICIENCY


def config_of(row: Dict) -> Dict[str, int]:
    return {k: int(v) for k, v in (kv.split("=") for kv in row["config"].split())}


def tiles_after(plan, n_anchor: int, block_size: int, block_m: int, block_n: int, r: int = 0) -> List[int]:
    """Context tiles of each anchor tile of row r (in anchor order) in the forward / dQ, as `_context_tiles`
    lays them (all of [min lo, max hi) of the tile's valid anchors, in tiles of block_n from min lo)."""
    per_tile = anchors_per_tile(block_m, block_size)
    lo, hi, valid = (x[r].tolist() for x in plan[:3])
    counts = []
    for a0 in range(0, n_anchor, per_tile):
        rows = [i for i in range(a0, min(a0 + per_tile, n_anchor)) if valid[i]]
        start = min((lo[i] for i in rows), default=0)
        counts.append(math.ceil(max(max((hi[i] for i in rows), default=0) - start, 0) / block_n))
    return counts


def forward_visited_pairs(plan, block_size: int, block_m: int, block_n: int) -> int:
    """(query, key) pairs the forward computes for one head, summed over rows: block_m x block_n per context
    tile and BLOCK_P x BLOCK_P per pack of own blocks."""
    n_anchor, block_p = plan.lo.shape[1], pack_rows(block_size)
    total = 0
    for r in range(plan.lo.shape[0]):
        counts = tiles_after(plan, n_anchor, block_size, block_m, block_n, r)
        total += sum(counts) * block_m * block_n + len(counts) * (block_m // block_p) * block_p * block_p
    return total


def tiles_before_query(plan, n_anchor: int, block_size: int, block_m: int, block_n: int, causal: bool):
    """Per query tile of the forward / dQ before issue 18 (in row order): context + own-block key tiles."""
    lo, hi, valid = (x[0].tolist() for x in plan[:3])
    n_q = n_anchor * block_size
    counts = []
    for m0 in range(0, n_q, block_m):
        m1 = min(m0 + block_m, n_q)
        rows = [m // block_size for m in range(m0, m1) if valid[m // block_size]]
        if not rows:
            counts.append(0)
            continue
        c_lo = min(lo[i] for i in rows) // block_n * block_n
        ctx = math.ceil(max(max(hi[i] for i in rows) - c_lo, 0) / block_n)
        b_lo, b_hi = m0 // block_size * block_size, min(((m1 - 1) // block_size + 1) * block_size, n_q)
        if causal:
            b_hi = min(b_hi, m1)
        counts.append(ctx + math.ceil((b_hi - b_lo) / block_n))
    return counts


def key_tile_iterations(
    ranges, t: int, n_anchor: int, block_size: int, group: int, block_m: int, block_n: int, packed: bool, r: int = 0
):
    """Per context key tile of row r in dK/dV: the iterations of its loop (g heads x query tiles)."""
    first, last = ranges[0][r].tolist(), ranges[1][r].tolist()
    out = []
    for n0 in range(0, t, block_n):
        n1 = min(n0 + block_n, t)
        if packed:  # after: anchor tiles of whole packed blocks
            out.append(group * math.ceil(max(last[n1 - 1] - first[n0], 0) / anchors_per_tile(block_m, block_size)))
        else:  # before: query rows of those anchors in tiles of block_m rows
            rows = max(min(last[n1 - 1] * block_size, n_anchor * block_size) - first[n0] * block_size, 0)
            out.append(group * math.ceil(rows / block_m))
    return out


def block_key_iterations(n_anchor: int, block_size: int, group: int, block_m: int, block_n: int, causal: bool):
    """Per block-key tile of the dK/dV before issue 18: g heads x query tiles of the same blocks."""
    n_q, out = n_anchor * block_size, []
    for n0 in range(0, n_q, block_n):
        n_last = min(n0 + block_n, n_q) - 1
        q_lo = n0 if causal else n0 // block_size * block_size
        q_hi = min((n_last // block_size + 1) * block_size, n_q)
        out.append(group * math.ceil((q_hi - q_lo) / block_m))
    return out


def makespan_us(programs_us: List[float], slots: int) -> float:
    """Programs taken in launch order by the first free of `slots` slots."""
    free = [0.0] * slots
    heapq.heapify(free)
    for p in programs_us:
        heapq.heappush(free, heapq.heappop(free) + p)
    return max(free)


def price(
    row: Dict, tile_flops: float, iterations: List[int], extra_flops: float = 0.0, extra_mma: str = ""
) -> Tuple[float, float]:
    """(modelled makespan us, visited FLOPs) of a launch whose programs run `iterations` tile iterations each,
    in launch order, plus `extra_flops` per program on the MMAs `extra_mma` (own-block packs)."""
    per_sm = row["per_sm"] or 1
    slot_rate = PEAK / SMS / per_sm / 1e6  # FLOPs per us of one resident program
    compute = tile_flops / (slot_rate * mma_efficiency(row["main_loop_mma"] or "none"))
    if not row["main_loop_async_copies"]:
        wait = LOAD_LATENCY_US
    else:
        wait = max(0.0, LOAD_LATENCY_US - (row["stages"] - 1) * compute)
    extra = extra_flops / (slot_rate * mma_efficiency(extra_mma)) if extra_flops else 0.0
    programs = [LOAD_LATENCY_US + extra + n * (compute + wait) for n in iterations]
    return makespan_us(programs, SMS * per_sm), tile_flops * sum(iterations) + extra_flops * len(iterations)


def launch_after(name: str, row: Dict, plan, ranges, t: int) -> Dict:
    """Modelled time, visited FLOPs and per-program iterations of one pass of the kernels now, one config."""
    hq, hkv, d, b, a = (SHAPE[k] for k in ("Hq", "Hkv", "D", "B", "A"))
    n_q = a * b
    if name == "block pass":
        bytes_moved = DTYPE_BYTES * n_q * d * (3 * hq + 4 * hkv) + 4 * n_q * hq * 2
        us = bytes_moved / (COPY_TB_S * 1e6)
        return dict(us=us, flops=4 * 2 * n_q * b * d * hq, iterations=[1] * (row["programs"] or 0))
    cfg = config_of(row)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if name == "context dK/dV":
        per_head = key_tile_iterations(ranges, t, a, b, hq // hkv, bm, bn, packed=True)
        launch = [n for n in per_head for _ in range(hkv)]  # kv head fastest
        us, flops = price(row, MMAS[name] * 2 * bm * bn * d, launch)
    else:
        counts, block_p = tiles_after(plan, a, b, bm, bn), pack_rows(b)
        launch = [n for n in reversed(counts) for _ in range(hq)]  # heads fastest, last tiles first
        packs = bm // block_p * MMAS[name] * 2 * block_p * block_p * d
        us, flops = price(row, MMAS[name] * 2 * bm * bn * d, launch, packs, row["other_mma"])
    return dict(us=us, flops=flops, iterations=launch)


def launch_before(name: str, row: Dict, plan, ranges, t: int) -> Dict:
    """The same for the kernels before issue 18."""
    hq, hkv, d, b, a = (SHAPE[k] for k in ("Hq", "Hkv", "D", "B", "A"))
    n_q = a * b
    if name == "preprocess":
        us = (DTYPE_BYTES * 2 * n_q * hq * d + 4 * n_q * hq) / (COPY_TB_S * 1e6)
        return dict(us=us, flops=0.0, iterations=[1] * (row["programs"] or 0))
    cfg = config_of(row)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if name == "context dK/dV":
        launch = key_tile_iterations(ranges, t, a, b, hq // hkv, bm, bn, packed=False) * hkv  # key tiles fastest
    elif name == "block dK/dV":
        launch = block_key_iterations(a, b, hq // hkv, bm, bn, causal=False) * hkv
    else:
        launch = list(reversed(tiles_before_query(plan, a, b, bm, bn, causal=False))) * hq  # tiles fastest
    us, flops = price(row, MMAS[name] * 2 * bm * bn * d, launch)
    return dict(us=us, flops=flops, iterations=launch)


def model(passes: Dict[str, str], launch, rows: Dict[str, List[Dict]], plan, ranges, t: int) -> List[Dict]:
    """One result row per pass: its config with the smallest modelled time (what the autotuner would pick)."""
    out = []
    for name, kernel in passes.items():
        candidates = [(row, launch(name, row, plan, ranges, t)) for row in rows.get(kernel, [])]
        if candidates:
            out.append(result_row(name, *min(candidates, key=lambda c: c[1]["us"])))
    return out


def result_row(name: str, row: Dict, cand: Dict) -> Dict:
    floor_us = cand["flops"] / PEAK * 1e6
    return {
        "pass": name,
        "kernel": row["kernel"],
        "config": f"{row['config']} w{row['warps']} s{row['stages']}",
        "spills": row["n_spills"],
        "main_loop_mma": row["main_loop_mma"],
        "async_copies": row["main_loop_async_copies"],
        "programs": len(cand["iterations"]),
        "per_sm": row["per_sm"],
        "waves": round(len(cand["iterations"]) / (SMS * (row["per_sm"] or 1)), 2),
        "max_iterations": max(cand["iterations"], default=0),
        "mean_iterations": round(sum(cand["iterations"]) / max(len(cand["iterations"]), 1), 1),
        "visited_tflop": round(cand["flops"] / 1e12, 4),
        "floor_us": round(floor_us, 1),
        "model_us": round(cand["us"], 1),
        "model_over_floor": round(cand["us"] / floor_us, 2) if floor_us else None,
    }


def visible_tflop(plan, causal: bool = False) -> float:
    """FLOPs of forward + backward on visible pairs only (4 + 10 per pair and channel, FA-2's count)."""
    return 14 * SHAPE["D"] * SHAPE["Hq"] * visible_pairs(plan, SHAPE["B"], causal) / 1e12


def load_rows(path: str) -> Dict[str, List[Dict]]:
    """compile_check rows of the attention kernels in bf16 at the reference shape, causal in block off, by
    kernel (a dK/dV kernel with an IS_CTX switch keyed with it), configs the autotuner can launch."""
    with open(path) as f:
        data = json.load(f)
    out: Dict[str, List[Dict]] = {}
    for r in data["rows"]:
        if r["op"] != "anchored_attention" or r["dtype"] != "bf16" or " reference causal=False" not in r["case"]:
            continue
        if r["status"] not in ("ok", "spills"):
            continue
        switch = [v for v in r["variant"].split() if v.startswith("IS_CTX=")]
        key = " ".join([r["kernel"], *switch])
        out.setdefault(key, []).append(r)
    return out


def static_table(path: str, design: str) -> List[Dict]:
    """One row per bf16 attention kernel, variant and config (causal in block off) of a compile_check report:
    its static facts, with programs and waves at T = 3072 (the reference shape) and 8192 (`long`)."""
    with open(path) as f:
        rows = [r for r in json.load(f)["rows"] if r["op"] == "anchored_attention" and r["dtype"] == "bf16"]
    at_long = {
        (r["kernel"], r["variant"], r["config"], r["warps"], r["stages"]): r
        for r in rows
        if " long causal=False" in r["case"]
    }
    table = []
    for r in rows:
        if " reference causal=False" not in r["case"]:
            continue
        long = at_long.get((r["kernel"], r["variant"], r["config"], r["warps"], r["stages"]), {})
        table.append(
            {
                "design": design,
                "kernel": " ".join([r["kernel"], *[v for v in r["variant"].split() if v.startswith("IS_CTX=")]]),
                "config": f"{r['config'].replace('BLOCK_SIZE=16 BLOCK_P=16 ', '')} w{r['warps']} s{r['stages']}",
                "regs": r["n_regs"],
                "spills": r["n_spills"],
                "smem_kb": round(r["smem_bytes"] / 1024) if r["smem_bytes"] is not None else None,
                "mma_loops_without_async": r.get("mma_loops_without_async"),
                "async_copies": r["main_loop_async_copies"],
                "ld_global": r["main_loop_sync_loads"],
                "main_loop_mma": r["main_loop_mma"],
                "widest_n": r["widest_mma_n"],
                "narrowest_n": r.get("narrowest_mma_n"),
                "per_sm": r["per_sm"],
                "programs_3072": r["programs"],
                "waves_3072": r["waves"],
                "programs_8192": long.get("programs"),
                "waves_8192": long.get("waves"),
                "status": r["status"],
            }
        )
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--after",
        default=os.path.join("bench", "results", "compile_check_attention"),
        help="folder with compile_check_<triton>.json of the kernels now",
    )
    p.add_argument("--before", default=None, help="folder with the compile_check report of the kernels before")
    p.add_argument("--triton", default="3.9.0", help="which compile_check_<version>.json to read")
    p.add_argument(
        "--out",
        default=os.path.join("bench", "results"),
        help="writes attention_model_<triton>.{json,md} and attention_static_<triton>.{json,md}",
    )
    args = p.parse_args(argv)
    designs = [("after", args.after, AFTER, launch_after)]
    if args.before:
        designs.insert(0, ("before", args.before, BEFORE, launch_before))
    results = []
    for t in SEQ_LENS:
        for docs_name, lengths in (("1 document", [t]), ("random documents", None)):
            document_ids, anchors, valid = make_row(t, SHAPE["A"], doc_lengths=lengths)
            plan = visibility_plan(anchors, valid, document_ids, None)
            ranges = context_ranges(plan, t, SHAPE["B"])
            for design, folder, kernels, launch in designs:
                rows = load_rows(os.path.join(folder, f"compile_check_{args.triton}.json"))
                passes = model(kernels, launch, rows, plan, ranges, t)
                total_floor = sum(r["floor_us"] for r in passes)
                total_model = sum(r["model_us"] for r in passes)
                for r in passes:
                    results.append(dict(T=t, rows=docs_name, design=design, **r))
                results.append(
                    dict(
                        T=t,
                        rows=docs_name,
                        design=design,
                        **{"pass": "total (fwd + bwd)"},
                        visited_tflop=round(sum(r["visited_tflop"] for r in passes), 4),
                        floor_us=round(total_floor, 1),
                        model_us=round(total_model, 1),
                        model_over_floor=round(total_model / total_floor, 2),
                        visible_tflop=round(visible_tflop(plan), 4),
                    )
                )
    meta = {
        "model": "modelled times, not measurements: tiles walked as the kernels walk them, priced at "
        f"{PEAK / 1e12:.0f} TFLOP/s over {SMS} SMs, MMA efficiency of the main loop's shapes, "
        f"{LOAD_LATENCY_US} us per non-pipelined iteration, {COPY_TB_S} TB/s for the memory-bound passes",
        "shape": SHAPE,
        "compile_check": {d[0]: os.path.join(d[1], f"compile_check_{args.triton}.json") for d in designs},
    }
    md = write_results(f"attention_model_{args.triton}", results, args.out, meta=meta)
    static = [
        row for d in designs for row in static_table(os.path.join(d[1], f"compile_check_{args.triton}.json"), d[0])
    ]
    meta_static = {"compile_check": meta["compile_check"], "rows": "bf16, causal in block off, every autotune config"}
    print(md + "\n" + write_results(f"attention_static_{args.triton}", static, args.out, meta=meta_static))
    return 0


if __name__ == "__main__":
    sys.exit(main())
