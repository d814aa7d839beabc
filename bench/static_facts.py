"""Static facts of a compiled Triton kernel, read off its PTX and ptxas log, and its occupancy on an SM.

Pure text and arithmetic (no Triton, no GPU): `bench/compile_check.py` applies it to every compile and
writes the facts into its rows; tests apply it to PTX excerpts. What each fact means is in
compile_check's module docstring.
"""

import re
from typing import Dict, List, Optional

# Per-block shared memory a kernel may opt into, shared memory per SM, and SMs (which size some grids), per
# compute capability (CUDA occupancy tables; every one of them: 64K registers, 64 warps, 32 blocks per SM).
ARCHS = {
    80: dict(smem=166912, smem_per_sm=167936, sms=108, gpu="A100"),
    90: dict(smem=232448, smem_per_sm=233472, sms=132, gpu="H100/H200"),
    100: dict(smem=232448, smem_per_sm=233472, sms=148, gpu="B200"),
}
REGISTERS_PER_SM = 65536
WARPS_PER_SM, BLOCKS_PER_SM = 64, 32
SMEM_RESERVED_PER_BLOCK = 1024  # the driver keeps 1 KB of shared memory per resident block

# A basic block starts at a label, or at LLVM's `// %bb.N:` comment for a block only reached by falling
# through; the comment lines after it say which loop it belongs to (llc's loop annotations).
_BLOCK_START = re.compile(r"^(?:\$L__(BB\d+_\d+):|// %bb\.\d+:)")
_LOOP_HEADER = re.compile(r"This\s+(?:Inner\s+)?Loop Header: Depth=\d+")
_IN_LOOP = re.compile(r"in Loop: Header=(BB\d+_\d+) Depth=\d+")
_MMA = re.compile(r"\b(wgmma\.mma_async|mma)\.sync\.aligned\.m(\d+)n(\d+)k(\d+)")
_ASYNC_COPY = re.compile(r"\bcp\.async\.(?:ca|cg|bulk)\.(?!commit|wait)")
_SYNC_LOAD = re.compile(r"\bld\.global\.")
_PERF_REMARK = re.compile(r"Potential Performance Loss: (.*)")
STATIC_FACTS = (
    "loops",
    "mma_loops_without_async",
    "main_loop_async_copies",
    "main_loop_sync_loads",
    "main_loop_mma",
    "widest_mma_n",
    "narrowest_mma_n",
    "other_mma",
    "ptxas_remarks",
)


def ptx_loops(ptx: str) -> Dict[Optional[str], List[str]]:
    """PTX instruction lines by the innermost loop that holds them (its header block, e.g. 'BB0_5'); None
    for instructions outside every loop. Loops are read from llc's comments on each block's first lines."""
    loops: Dict[Optional[str], List[str]] = {None: []}
    loop, reading_notes = None, False
    for line in ptx.splitlines():
        text = line.strip()
        start = _BLOCK_START.match(text)
        if start:
            label, loop, notes, reading_notes = start.group(1), None, text, True
        elif reading_notes and text.startswith("//"):
            notes += " " + text
        else:
            reading_notes = False
        if start or reading_notes:
            header = _IN_LOOP.search(notes)
            loop = label if label and _LOOP_HEADER.search(notes) else header.group(1) if header else None
            continue
        if text and not text.startswith(("//", ".loc", "$", "{", "}")):
            loops.setdefault(loop, []).append(text)
    return loops


def _mma_shapes(lines: List[str]) -> Dict[str, int]:
    """'wgmma m64n128k16' / 'mma m16n8k16' -> instruction count."""
    shapes: Dict[str, int] = {}
    for line in lines:
        for kind, m, n, k in _MMA.findall(line):
            name = f"{'wgmma' if kind.startswith('wgmma') else 'mma'} m{m}n{n}k{k}"
            shapes[name] = shapes.get(name, 0) + 1
    return shapes


def _shape_list(shapes: Dict[str, int]) -> str:
    return ", ".join(f"{name} x{count}" for name, count in sorted(shapes.items())) or "none"


def static_facts(ptx: str, ptxas_log: str = "") -> Dict[str, object]:
    """What a kernel's PTX says about its main loop (module docstring), and ptxas's performance remarks."""
    loops = ptx_loops(ptx)
    bodies = {header: lines for header, lines in loops.items() if header is not None}
    facts: Dict[str, object] = dict.fromkeys(STATIC_FACTS)
    facts["loops"] = len(bodies)
    facts["ptxas_remarks"] = "; ".join(sorted(set(_PERF_REMARK.findall(ptxas_log)))) or ""
    if not bodies:
        facts["other_mma"] = _shape_list(_mma_shapes(loops[None]))
        return facts
    mma_loops = [h for h, lines in bodies.items() if _mma_shapes(lines)]
    facts["mma_loops_without_async"] = sum(not any(_ASYNC_COPY.search(line) for line in bodies[h]) for h in mma_loops)
    main = max(bodies, key=lambda h: (sum(_mma_shapes(bodies[h]).values()), len(bodies[h])))
    body = bodies[main]
    shapes = _mma_shapes(body)
    facts["main_loop_async_copies"] = sum(bool(_ASYNC_COPY.search(line)) for line in body)
    facts["main_loop_sync_loads"] = sum(bool(_SYNC_LOAD.search(line)) for line in body)
    facts["main_loop_mma"] = _shape_list(shapes)
    widths = [int(re.search(r"n(\d+)", name).group(1)) for name in shapes]
    facts["widest_mma_n"], facts["narrowest_mma_n"] = max(widths, default=0), min(widths, default=0)
    facts["other_mma"] = _shape_list(_mma_shapes([line for h, lines in loops.items() if h != main for line in lines]))
    return facts


def occupancy(arch: int, n_regs: int, warps: int, smem: int, programs: Optional[int]) -> Dict[str, object]:
    """Programs resident on one SM at once (registers are allocated per warp in units of 256, shared memory
    per block plus the driver's reserve) and the waves `programs` make on the arch's SMs."""
    spec = ARCHS[arch]
    by_regs = REGISTERS_PER_SM // (-(-n_regs * 32 // 256) * 256) // warps
    by_smem = spec["smem_per_sm"] // (smem + SMEM_RESERVED_PER_BLOCK)
    per_sm = min(by_regs, by_smem, WARPS_PER_SM // warps, BLOCKS_PER_SM)
    waves = round(programs / (per_sm * spec["sms"]), 2) if programs and per_sm else None
    return {"per_sm": per_sm, "waves": waves}
