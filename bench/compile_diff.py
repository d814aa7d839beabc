"""What changed in the compiled kernels between two compile_check reports: registers, spills, shared memory and
every static fact, row by row (a row: kernel, case, variant, config, warps, stages).

A refactor of a kernel that means to change nothing in the compiled code runs compile_check before and after,
on the same Triton, and checks here that no row differs:

    python bench/compile_check.py --ops anchored_attention --dtypes bf16 --shapes reference --out /tmp/before
    # ... the change ...
    python bench/compile_check.py --ops anchored_attention --dtypes bf16 --shapes reference --out /tmp/after
    python bench/compile_diff.py /tmp/before/compile_check_3.9.0.json /tmp/after/compile_check_3.9.0.json

Exits 0 when both reports hold the same rows with the same facts, 1 otherwise (each difference on a line).
"""

import argparse
import json
import os
import sys
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.static_facts import STATIC_FACTS  # noqa: E402

ROW_KEY = ("op", "kernel", "case", "variant", "config", "warps", "stages")
COMPARED = ("status", "n_regs", "n_spills", "spill_store_bytes", "smem_bytes", *STATIC_FACTS)


def read_rows(path: str, ops=None) -> Dict[Tuple, Dict]:
    with open(path) as f:
        rows = json.load(f)["rows"]
    return {tuple(r[k] for k in ROW_KEY): r for r in rows if ops is None or r["op"] in ops}


def differences(before: Dict[Tuple, Dict], after: Dict[Tuple, Dict]) -> List[str]:
    """One line per row only one report has, and per compared fact that differs."""
    lines = [f"only before: {' | '.join(map(str, k))}" for k in sorted(set(before) - set(after), key=str)]
    lines += [f"only after: {' | '.join(map(str, k))}" for k in sorted(set(after) - set(before), key=str)]
    for key in sorted(set(before) & set(after), key=str):
        for field in COMPARED:
            old, new = before[key].get(field), after[key].get(field)
            if old != new:
                lines.append(f"{' | '.join(map(str, key[1:]))}: {field} {old!r} -> {new!r}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before", help="compile_check_<triton>.json of the code before")
    p.add_argument("after", help="compile_check_<triton>.json of the code after")
    p.add_argument("--ops", default=None, help="comma-separated: compare these ops' rows only")
    args = p.parse_args(argv)
    ops = set(args.ops.split(",")) if args.ops else None
    before, after = read_rows(args.before, ops), read_rows(args.after, ops)
    lines = differences(before, after)
    print("\n".join(lines) if lines else f"no difference in {len(before)} rows")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
