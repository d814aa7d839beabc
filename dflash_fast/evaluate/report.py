"""What an evaluation reports, whichever engine decoded: the per-block tally, acceptance by drafted position and by
context length, the confidence head's calibration, per-prompt rows, the JSON report and its one-paragraph summary.

`tau` is the mean acceptance length per verification forward (n + 1, counted before the output is cut at eos /
max_new_tokens), all blocks of all prompts pooled; `acceptance_histogram[n]` counts the blocks that accepted exactly
n drafted tokens. `tau_zlab` is the published definition (z-lab's `dflash` 0.1.0 benchmark.py, "Average Acceptance
length"): each block's length cut at the stop token / token limit (cut_acceptance_lengths), averaged per prompt, then
the per-prompt means averaged.
"""

from typing import Dict, List, Optional, Sequence, Tuple

from dflash_fast.evaluate.decode import SpecResult


def mean_acceptance(histogram: Sequence[int]) -> Optional[float]:
    """tau from histogram[n] = blocks that accepted n drafted tokens (each yields n + 1); None without blocks."""
    blocks = sum(histogram)
    return sum((n + 1) * c for n, c in enumerate(histogram)) / blocks if blocks else None


FIRST_CONTEXT_BUCKET = 64  # context buckets: [0, 64), [64, 128), [128, 256), ... tokens


def context_bucket(length: int) -> Tuple[int, int]:
    """The bucket [lo, hi) of a context `length` (prompt + generated tokens, the anchor included)."""
    if length < FIRST_CONTEXT_BUCKET:
        return 0, FIRST_CONTEXT_BUCKET
    lo = FIRST_CONTEXT_BUCKET
    while 2 * lo <= length:
        lo *= 2
    return lo, 2 * lo


def acceptance_by_context(buckets: Dict[int, List[int]]) -> List[Dict]:
    """{bucket lo: histogram} -> one entry per bucket with blocks, in context order: tau and the histogram."""
    out = []
    for lo in sorted(buckets):
        histogram = buckets[lo]
        _, hi = context_bucket(lo)
        out.append({"context": f"{lo}-{hi - 1}", "blocks": sum(histogram), "tau": mean_acceptance(histogram),
                    "acceptance_histogram": histogram})
    return out


def acceptance_by_position(histogram: Sequence[int]) -> List[Dict]:
    """Per drafted position j = 1..B-1: `accepted`, the fraction of blocks that accepted draft j (all of 1..j
    matched), and `conditional`, that fraction among the blocks that accepted j - 1 (None where none did)."""
    blocks = sum(histogram)
    reached = [sum(histogram[j:]) for j in range(len(histogram))]  # reached[j]: blocks that accepted >= j drafts
    return [{"position": j, "accepted": reached[j] / blocks if blocks else None,
             "conditional": reached[j] / reached[j - 1] if reached[j - 1] else None}
            for j in range(1, len(histogram))]


def cut_acceptance_lengths(spec: SpecResult) -> List[int]:
    """Each block's new tokens as z-lab's dflash_generate counts them: n + 1, cut where the output ends (the first
    stop token, or max_new_tokens). The first block's anchor is the first output token, so the block at anchor a
    starts after a - anchors[0] + 1 output tokens. (z-lab verifies a shorter block near the token limit where we
    draft B-1 and cut: only the last block of an output that reaches the limit can count differently.)"""
    if not spec.anchors:
        return []
    out = len(spec.tokens)
    return [max(0, min(n + 1, out - (a - spec.anchors[0] + 1))) for a, n in zip(spec.anchors, spec.accepted)]


def tau_zlab(results: Sequence[SpecResult]) -> Optional[float]:
    """The mean over prompts (those with a block) of each prompt's mean cut acceptance length; None without one."""
    means = [sum(c) / len(c) for c in (cut_acceptance_lengths(r) for r in results) if c]
    return sum(means) / len(means) if means else None


class Tally:
    """What the prompts add up to: acceptance (overall, per context bucket), token counts and seconds."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.histogram = [0] * block_size
        self.by_context: Dict[int, List[int]] = {}
        self.spec_tokens, self.spec_s, self.greedy_tokens, self.greedy_s = 0, 0.0, 0, 0.0
        self.recompute, self.mismatches, self.tau_sum, self.blocks = 0, 0, 0.0, 0
        # confidence calibration per drafted position j (index j - 1): blocks that reached j, the predicted
        # acceptance summed over them, and how many of them accepted draft j
        self.reached, self.predicted, self.accepted_at = ([0.0] * (block_size - 1) for _ in range(3))
        self.with_confidence = False
        self.results: List[SpecResult] = []  # one per prompt, in order
        self.matches: List[bool] = []  # per prompt: the speculative output equals the target's plain greedy one

    def add_speculative(self, spec: SpecResult) -> None:
        self.results.append(spec)
        for anchor, n in zip(spec.anchors, spec.accepted):
            self.histogram[n] += 1
            lo, _ = context_bucket(anchor + 1)  # x_0..x_T: the prompt and every token generated so far
            self.by_context.setdefault(lo, [0] * self.block_size)[n] += 1
        for predicted, n in zip(spec.confidence or [], spec.accepted):
            self.with_confidence = True
            for j in range(min(n + 1, self.block_size - 1)):  # drafts 1..n accepted, draft n + 1 reached
                self.reached[j] += 1
                self.predicted[j] += predicted[j]
                self.accepted_at[j] += j < n
        self.spec_tokens += len(spec.tokens)
        self.spec_s += spec.seconds
        self.recompute += spec.recompute_forwards

    def add_greedy(self, tokens: List[int], seconds: float, spec: SpecResult, compare: bool = True) -> None:
        """The target's own run of the prompt of `spec`; `compare` (greedy only: sampled runs differ by chance)
        counts whether the speculative output equals it."""
        self.greedy_tokens += len(tokens)
        self.greedy_s += seconds
        if compare:
            self.mismatches += tokens != spec.tokens
            self.matches.append(tokens == spec.tokens)


def confidence_calibration(tally: Tally) -> Optional[List[Dict]]:
    """Per drafted position j: the blocks that reached it, the confidence head's mean predicted acceptance and the
    measured acceptance over them (None where no block reached j); None without a confidence head."""
    if not tally.with_confidence:
        return None
    return [{"position": j + 1, "blocks": int(reached),
             "predicted": tally.predicted[j] / reached if reached else None,
             "measured": tally.accepted_at[j] / reached if reached else None}
            for j, reached in enumerate(tally.reached)]


def per_prompt(tally: Tally) -> List[Dict]:
    """Each prompt's acceptance (tau of its own blocks, each block's accepted drafts) and output tokens, for comparing
    engines prompt by prompt and, sampled, run by run (evaluate/vllm.py agreement)."""
    rows = []
    for i, spec in enumerate(tally.results):
        row = {"tau": 1 + sum(spec.accepted) / len(spec.accepted) if spec.accepted else None,
               "blocks": len(spec.accepted), "accepted": list(spec.accepted), "tokens": spec.tokens}
        if i < len(tally.matches):
            row["greedy_match"] = tally.matches[i]
        rows.append(row)
    return rows


def report(tally: Tally, baseline: bool, **header) -> Dict:
    report = {
        **header,
        "tau": mean_acceptance(tally.histogram),
        "tau_zlab": tau_zlab(tally.results),
        "acceptance_histogram": tally.histogram,
        "acceptance_by_context": acceptance_by_context(tally.by_context),
        "acceptance_by_position": acceptance_by_position(tally.histogram),
        "confidence_calibration": confidence_calibration(tally),
        "verify_forwards": sum(tally.histogram),
        "recompute_forwards": tally.recompute,
        "new_tokens": tally.spec_tokens,
        "tokens_per_s": tally.spec_tokens / tally.spec_s if tally.spec_s else None,
        "tau_offline": tally.tau_sum / tally.blocks if tally.blocks else None,
        "offline_blocks": tally.blocks,
        "per_prompt": per_prompt(tally),
    }
    if baseline:
        target_tps = tally.greedy_tokens / tally.greedy_s if tally.greedy_s else None
        report.update(
            target_tokens_per_s=target_tps,
            speedup=report["tokens_per_s"] / target_tps if target_tps and report["tokens_per_s"] else None,
            greedy_mismatches=tally.mismatches if tally.matches else None,  # None: sampled, nothing to compare
        )
    return report


def summary(report: Dict) -> str:
    """The report's acceptance in a few lines: tau, tau_offline, by context bucket, by drafted position."""

    def num(value, digits=2):
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [f"tau {num(report['tau'], 3)} over {report['verify_forwards']} blocks "
             f"(tau_zlab, z-lab's per-prompt mean: {num(report.get('tau_zlab'), 3)}), "
             f"tau_offline {num(report['tau_offline'], 3)}, greedy mismatches {report.get('greedy_mismatches', '-')}",
             "tau by context length (prompt + generated tokens):"]
    lines += [f"  {b['context']:>11}: {num(b['tau'])} ({b['blocks']} blocks)" for b in report["acceptance_by_context"]]
    lines.append("accepted by drafted position (fraction of blocks; given the one before):")
    lines += [f"  {p['position']:>3}: {num(p['accepted'], 3)} ({num(p['conditional'], 3)})"
              for p in report["acceptance_by_position"]]
    if report.get("confidence_calibration"):
        lines.append("confidence head by drafted position: predicted vs measured acceptance (blocks reaching it):")
        lines += [f"  {c['position']:>3}: {num(c['predicted'], 3)} vs {num(c['measured'], 3)} ({c['blocks']})"
                  for c in report["confidence_calibration"]]
    return "\n".join(lines)
