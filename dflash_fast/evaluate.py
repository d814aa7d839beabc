"""`dflash-fast eval`: real block speculative decoding with an HF target and a drafter (SPEC §6).

    prompt ──target prefill──▶ x_T (the first bonus token), taps of 0..T-1
    loop:
      propose(hidden[0..T-1], x_T) ──▶ g_1..g_{B-1}                one drafter forward
      target([x_T, g_1..g_{B-1}], cache) ──▶ y_0..y_{B-1}          one verification forward
      n = leading j with g_j == y_{j-1};  emit g_1..g_n and the bonus y_n
      keep the taps of T..T+n; roll the cache back to T+n+1;  x_{T+n+1} = y_n

Every emitted token is a target argmax given the tokens before it, so greedy
speculative output is the target's own greedy output. Cache rollback: full
attention layers are cropped; layers that cannot be cropped (recurrent state
of Qwen3-Next / Qwen3.5 linear attention, sliding windows) are copied before
the verification and restored after a rejection, then the accepted tokens are
re-run through the target (one extra forward, counted as `recompute_forwards`).

`tau` is the mean acceptance length per verification forward, n + 1 counted
before the output is cut at eos / max_new_tokens; `acceptance_histogram[n]`
counts the blocks that accepted exactly n drafted tokens. `tau_offline` runs
the drafter's training forward over the target's own greedy output (an anchor
at every eligible response position) and averages SPEC §6's per-block value.

DSpark drafters (SPEC §8) draft their block as the engines do, slot k's Markov bias from the token drafted
at slot k-1 (DFlashDrafter.propose); with sample_from_anchor they draft B tokens, so a verification block
is B + 1 tokens. With a confidence head, `confidence_calibration` compares per drafted position j the
head's mean predicted acceptance with the measured one, both over the blocks that reached j (accepted
drafts 1..j-1).
"""
import contextlib
import copy
import inspect
import json
import os
import sys
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from dflash_fast.cli import call_with_flags
from dflash_fast.drafter import DFlashDrafter, slot_metrics
from dflash_fast.errors import UserError
from dflash_fast.layer_ids import check_layer_ids, default_layer_ids
from dflash_fast.regenerate import (
    add_model_arguments,
    cut_response,
    encode_prompt,
    eos_token_ids,
    load_model,
    read_prompts,
)
from dflash_fast.target import LayerTaps, check_target
from dflash_fast.weights import load_frozen_tensors

# propose(hidden [T, K, H_t] of positions 0..T-1, anchor token x_T, context_ids [T+1] = x_0..x_T) -> [B-1] guesses,
# or (guesses, their predicted acceptance probabilities [B-1]).
Proposer = Callable[[torch.Tensor, int, torch.Tensor], Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]]


class Step(NamedTuple):
    logits: torch.Tensor  # [n, V]
    hidden: Optional[torch.Tensor]  # [n, K, H_t] tapped layers; None without taps
    last: Optional[torch.Tensor]  # [n, H_t] residual entering the final norm; None without taps
    cache: object


class TargetRunner:
    """One sequence through an HF causal LM with a KV cache, tapping layer ids as extraction does:
    id l < L-1 is HF hidden_states[l + 1]; id L-1 is the input of the final norm (SPEC §1-2)."""

    def __init__(self, model, layer_ids: Sequence[int]):
        self.model = model
        self.num_layers = model.config.get_text_config().num_hidden_layers
        self.layer_ids = check_layer_ids(layer_ids, self.num_layers)
        self.device = next(model.parameters()).device
        # transformers 5.2x names the cache argument and output `cache`; earlier 5.x releases (vLLM 0.32 pins
        # transformers < 5.20) name it `past_key_values`.
        self._cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.taps = LayerTaps(model, self.layer_ids)

    @torch.inference_mode()
    def forward(self, ids: Sequence[int], cache=None, taps: bool = True) -> Step:
        """ids [n] appended after what `cache` holds (None: a fresh sequence)."""
        x = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        with self.taps if taps else contextlib.nullcontext():
            out = self.model(input_ids=x, use_cache=True, **{self._cache_name: cache})
        cache = getattr(out, self._cache_name, None)
        if cache is None:
            import transformers

            raise UserError(
                f"{type(self.model).__name__} returned no `{self._cache_name}` (transformers "
                f"{transformers.__version__}); speculative decoding needs a model that takes and returns its KV cache"
            )
        if not taps:
            return Step(out.logits[0], None, None, cache)
        hidden, last = self.taps.take()
        return Step(out.logits[0], hidden[0], last[0], cache)


def _croppable(layer) -> bool:
    from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

    return (
        isinstance(layer, DynamicLayer)
        and layer.is_croppable
        and not getattr(layer, "is_sliding", False)
        and not isinstance(layer, LinearAttentionCacheLayerMixin)
    )


def snapshot(cache) -> Dict[int, object]:
    """Copies of the cache layers `crop` cannot put back (recurrent, sliding); {} for a dense cache."""
    return {i: copy.deepcopy(layer) for i, layer in enumerate(cache.layers) if not _croppable(layer)}


def rollback(runner: TargetRunner, cache, saved: Dict[int, object], block: Sequence[int], keep: int) -> bool:
    """After verifying `block` (B tokens), leave `cache` holding only its first `keep` tokens.
    Returns True when that took a recompute forward."""
    drop = len(block) - keep
    if drop == 0:
        return False
    if not saved:
        cache.crop(-drop)
        return False
    for i, layer in enumerate(cache.layers):
        if i in saved:
            cache.layers[i] = saved[i]
        else:
            layer.crop(-len(block))
    runner.forward(block[:keep], cache, taps=False)
    return True


class SpecResult(NamedTuple):
    tokens: List[int]  # new tokens, cut after the first eos and at max_new_tokens
    accepted: List[int]  # drafted tokens accepted per verification block
    anchors: List[int]  # position of each block's anchor x_T
    recompute_forwards: int
    seconds: float
    confidence: Optional[List[List[float]]] = None  # per block, the proposer's acceptance probability per draft


def _finished(tokens: List[int], max_new_tokens: int, eos: Sequence[int]) -> bool:
    return len(tokens) >= max_new_tokens or any(t in eos for t in tokens)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def speculative_generate(
    runner: TargetRunner,
    prompt_ids: Sequence[int],
    propose: Proposer,
    block_size: int,
    max_new_tokens: int,
    eos: Sequence[int] = (),
) -> SpecResult:
    """Block speculative greedy decoding of one prompt; the loop in this module's docstring."""
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 (an anchor and at least one drafted token), got {block_size}")
    t0 = time.perf_counter()
    step = runner.forward(prompt_ids)
    cache, hidden = step.cache, step.hidden
    seq = list(prompt_ids) + [int(step.logits[-1].argmax())]
    accepted, anchors, recomputes, confidence = [], [], 0, []
    while not _finished(seq[len(prompt_ids) :], max_new_tokens, eos):
        anchor = seq[-1]
        drafts = propose(hidden, anchor, torch.tensor(seq, device=runner.device))
        if isinstance(drafts, tuple):
            drafts, predicted = drafts
            confidence.append([float(c) for c in predicted.reshape(-1).tolist()])
        drafts = [int(t) for t in torch.as_tensor(drafts).reshape(-1).tolist()]
        if len(drafts) != block_size - 1:
            raise ValueError(
                f"the proposer returned {len(drafts)} tokens for a block of {block_size}; "
                f"it must return block_size - 1 = {block_size - 1}"
            )
        block = [anchor] + drafts
        saved = snapshot(cache)
        step = runner.forward(block, cache)
        target = step.logits.argmax(-1).tolist()  # target[j] is the target's token for position T + j + 1
        n = next((j for j in range(block_size - 1) if drafts[j] != target[j]), block_size - 1)
        anchors.append(len(seq) - 1)
        accepted.append(n)
        seq += drafts[:n] + [target[n]]
        hidden = torch.cat([hidden, step.hidden[: n + 1]])
        if not _finished(seq[len(prompt_ids) :], max_new_tokens, eos):
            recomputes += rollback(runner, cache, saved, block, n + 1)
    _sync(runner.device)
    tokens = cut_response(seq[len(prompt_ids) :], max_new_tokens, eos)
    return SpecResult(tokens, accepted, anchors, recomputes, time.perf_counter() - t0, confidence or None)


@torch.inference_mode()
def greedy_generate(
    runner: TargetRunner, prompt_ids: Sequence[int], max_new_tokens: int, eos: Sequence[int] = ()
) -> Tuple[List[int], float]:
    """The target alone, one token per forward with its cache -> (new tokens, seconds)."""
    t0 = time.perf_counter()
    step = runner.forward(prompt_ids, taps=False)
    out = [int(step.logits[-1].argmax())]
    while not _finished(out, max_new_tokens, eos):
        step = runner.forward(out[-1:], step.cache, taps=False)
        out.append(int(step.logits[-1].argmax()))
    _sync(runner.device)
    return cut_response(out, max_new_tokens, eos), time.perf_counter() - t0


def response_row(step: Step, ids: Sequence[int], prompt_len: int) -> Dict[str, torch.Tensor]:
    """One sequence as a training row (dflash_fast.batches keys, no anchors yet): the target's
    forward `step` over `ids` [t]; the loss mask covers the response, positions prompt_len..t-1."""
    t, dev = len(ids), step.logits.device
    return dict(
        input_ids=torch.tensor([list(ids)], device=dev),
        loss_mask=(torch.arange(t, device=dev) >= prompt_len)[None],
        document_ids=torch.zeros(1, t, dtype=torch.long, device=dev),
        position_ids=torch.arange(t, device=dev)[None],
        hidden=step.hidden[None],
        last=step.last[None],
    )


@torch.inference_mode()
def offline_tau(
    runner: TargetRunner,
    drafter: DFlashDrafter,
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    anchors: Optional[Sequence[int]] = None,
    anchors_per_forward: int = 32,
) -> Tuple[float, int]:
    """SPEC §6 tau_offline sums over one sequence -> (tau_sum, blocks).

    One target forward over prompt + response gives `hidden` and `last`; the drafter's training
    forward then scores blocks at `anchors` (default: every response position a with a + 1 in the
    response), `anchors_per_forward` at a time to bound its [A*B] queries.
    """
    ids = list(prompt_ids) + list(response_ids)
    row = response_row(runner.forward(ids), ids, len(prompt_ids))
    anchors = list(range(len(prompt_ids), len(ids) - 1)) if anchors is None else sorted(anchors)
    tau_sum, blocks = 0.0, 0
    for a in range(0, len(anchors), anchors_per_forward):
        chunk = torch.tensor([anchors[a : a + anchors_per_forward]], device=runner.device)
        # kl: the full teacher of `last` (its argmax is ce's label; a DSpark confidence head needs the full teacher)
        out = drafter(dict(row, anchors=chunk, anchor_valid=torch.ones_like(chunk, dtype=torch.bool)), loss_kind="kl")
        m = slot_metrics(out)
        tau_sum += float(m["tau_sum"])
        blocks += int(m["blocks"])
    return tau_sum, blocks


def load_drafter(path: str, target: str) -> DFlashDrafter:
    """An export directory (speculators or z-lab layout), or a trainer checkpoint; frozen tensors from `target`."""
    from dflash_fast.export import load_exported

    if not os.path.exists(path):
        raise FileNotFoundError(
            f"drafter {path} does not exist: pass a `dflash-fast export` directory or a trainer checkpoint"
        )
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "config.json")):
        # checkpoints hold no config.json: this is an export (load_exported names what is wrong with it)
        return load_exported(path, target)
    from dflash_fast.checkpoint import load_drafter_for_export

    drafter, _ = load_drafter_for_export(path)
    drafter.set_frozen(**load_frozen_tensors(target))
    return drafter


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


def _check_drafter(drafter: DFlashDrafter, model) -> None:
    hidden_size, vocab = model.config.get_text_config().hidden_size, model.get_output_embeddings().weight.shape[0]
    cfg = drafter.config
    if (cfg.target_hidden_size, cfg.vocab_size) != (hidden_size, vocab):
        raise ValueError(
            f"the drafter was built for a target with hidden size {cfg.target_hidden_size} and vocabulary "
            f"{cfg.vocab_size}; this target has {hidden_size} and {vocab}: pass the drafter's own target"
        )


class Proposal(NamedTuple):
    module: Optional[DFlashDrafter]  # None for a proposer callable (no tau_offline)
    propose: Proposer
    block_size: int
    layer_ids: List[int]


def _proposal(drafter, model, target: str, block_size: Optional[int], layer_ids) -> Proposal:
    """What `evaluate` drafts with, from a DFlashDrafter, a path or a Proposer callable."""
    if isinstance(drafter, str):
        drafter = load_drafter(drafter, target)
    if isinstance(drafter, DFlashDrafter):
        _check_drafter(drafter, model)
        module = drafter.to(device=model.device, dtype=model.dtype).eval()
        cfg, with_confidence = module.config, module.confidence_head is not None
        # verification block: the anchor and the drafted tokens (B of them with sample_from_anchor)
        return Proposal(module, lambda hidden, anchor, _ids: module.propose(hidden, anchor, with_confidence),
                        cfg.drafted_tokens + 1, list(cfg.layer_ids))
    if callable(drafter):
        if block_size is None:
            raise ValueError("a proposer callable needs block_size (B: the anchor plus B-1 drafted tokens)")
        if layer_ids is None:
            layer_ids = default_layer_ids(model.config.get_text_config().num_hidden_layers)
        return Proposal(None, drafter, block_size, list(layer_ids))
    raise TypeError(f"drafter must be a DFlashDrafter, a path or a proposer callable, not {type(drafter).__name__}")


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

    def add_greedy(self, tokens: List[int], seconds: float, spec: SpecResult) -> None:
        self.greedy_tokens += len(tokens)
        self.greedy_s += seconds
        self.mismatches += tokens != spec.tokens
        self.matches.append(tokens == spec.tokens)


def _decode_all(runner: TargetRunner, encoded: List[List[int]], proposal: Proposal, max_new_tokens: int,
                eos: Sequence[int], offline: bool, baseline: bool, progress: bool) -> Tally:
    """Speculative decoding of every prompt; with `baseline` the target's own greedy loop too, with `offline`
    tau_offline over the greedy output (the speculative output without `baseline`)."""
    from tqdm import tqdm

    tally = Tally(proposal.block_size)
    bar = tqdm(encoded, unit="prompt", desc="eval", disable=not progress)
    for ids in bar:
        spec = speculative_generate(runner, ids, proposal.propose, proposal.block_size, max_new_tokens, eos)
        tally.add_speculative(spec)
        if sum(tally.histogram):
            bar.set_postfix(tau=f"{mean_acceptance(tally.histogram):.2f}")
        reference = spec.tokens
        if baseline:
            reference, seconds = greedy_generate(runner, ids, max_new_tokens, eos)
            tally.add_greedy(reference, seconds, spec)
        if offline and proposal.module is not None and len(reference) > 1:
            tau_sum, blocks = offline_tau(runner, proposal.module, ids, reference)
            tally.tau_sum += tau_sum
            tally.blocks += blocks
    return tally


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
    """Each prompt's acceptance (tau of its own blocks) and output tokens, for comparing engines prompt by prompt."""
    rows = []
    for i, spec in enumerate(tally.results):
        row = {"tau": 1 + sum(spec.accepted) / len(spec.accepted) if spec.accepted else None,
               "blocks": len(spec.accepted), "tokens": spec.tokens}
        if i < len(tally.matches):
            row["greedy_match"] = tally.matches[i]
        rows.append(row)
    return rows


def _report(tally: Tally, baseline: bool, **header) -> Dict:
    report = {
        **header,
        "tau": mean_acceptance(tally.histogram),
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
            greedy_mismatches=tally.mismatches,
        )
    return report


def evaluate(
    target: str,
    data: Union[str, Sequence[Dict]],
    drafter: Union[DFlashDrafter, str, Proposer],
    block_size: Optional[int] = None,
    layer_ids: Optional[Sequence[int]] = None,
    max_new_tokens: int = 128,
    num_prompts: Optional[int] = None,
    offline: bool = True,
    baseline: bool = True,
    device=None,
    dtype: Optional[str] = None,
    trust_remote_code: bool = False,
    progress: bool = True,
) -> Dict:
    """Speculative decoding of every prompt in `data` (regenerate's JSONL formats, or records) -> report dict.

    `drafter`: a DFlashDrafter, a path (an export of either layout or a trainer checkpoint), or a Proposer
    callable (then `block_size` is required and `layer_ids` defaults to 5 spread ids).
    `baseline` times the target's plain greedy loop and counts prompts where the speculative
    output differs from it; `offline` adds tau_offline over that greedy output (drafters only).
    """
    from transformers import AutoTokenizer

    check_target(target)
    prompts = read_prompts(data, num_prompts)
    tokenizer = AutoTokenizer.from_pretrained(target, trust_remote_code=trust_remote_code)
    model = load_model(target, device, dtype, trust_remote_code)
    name = drafter if isinstance(drafter, str) else getattr(drafter, "__name__", type(drafter).__name__)
    proposal = _proposal(drafter, model, target, block_size, layer_ids)
    runner = TargetRunner(model, proposal.layer_ids)
    eos = eos_token_ids(model.generation_config, tokenizer)
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    if runner.device.type == "cuda":  # first-call kernel selection and allocation stay out of the timings
        warm = min(max_new_tokens, 2 * proposal.block_size)
        speculative_generate(runner, encoded[0], proposal.propose, proposal.block_size, warm, eos)
        greedy_generate(runner, encoded[0], warm, eos)
    tally = _decode_all(runner, encoded, proposal, max_new_tokens, eos, offline, baseline, progress)
    return _report(
        tally,
        baseline,
        engine="hf",
        target=target,
        drafter=name,
        device=str(runner.device),
        dtype=str(model.dtype).replace("torch.", ""),
        prompts=len(prompts),
        block_size=proposal.block_size,
        layer_ids=proposal.layer_ids,
        max_new_tokens=max_new_tokens,
    )


def summary(report: Dict) -> str:
    """The report's acceptance in a few lines: tau, tau_offline, by context bucket, by drafted position."""

    def num(value, digits=2):
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [f"tau {num(report['tau'], 3)} over {report['verify_forwards']} blocks, "
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


def add_arguments(parser) -> None:
    p = parser
    p.add_argument("--target", required=True, help="Hugging Face causal LM: local directory or hub id")
    p.add_argument(
        "--drafter",
        required=True,
        help="export directory (dflash-fast export, speculators or zlab layout) or trainer checkpoint",
    )
    p.add_argument(
        "--data", required=True, help="prompts JSONL, as for regenerate: {conversations: [...]} or {text: ...}"
    )
    p.add_argument("--num-prompts", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt (default 128)")
    p.add_argument(
        "--no-baseline", action="store_true", help="skip the target-only greedy loop (no speedup, no identity check)"
    )
    p.add_argument("--no-offline", action="store_true", help="skip tau_offline")
    p.add_argument(
        "--engine", choices=["hf", "vllm", "both"], default="hf",
        help="hf: this loop (default); vllm: vLLM serving the export (docs/vllm.md); both: the two side by side",
    )
    add_model_arguments(p)
    p.add_argument("--out", default=None, help="write the JSON report here instead of stdout")


def run(args) -> int:
    if args.engine != "hf" and args.device is not None:
        raise ValueError(f"--device {args.device}: vLLM picks its own device; leave --device out with --engine "
                         f"{args.engine}")
    if args.engine == "hf":
        report = call_with_flags(evaluate, args, offline=not args.no_offline, baseline=not args.no_baseline)
        text = summary(report)
    else:
        from dflash_fast import vllm_engine  # vLLM is imported only here (it is an optional install)

        report = call_with_flags(vllm_engine.evaluate_vllm, args, baseline=not args.no_baseline)
        text = summary(report)
        if args.engine == "both":
            ours = call_with_flags(evaluate, args, offline=not args.no_offline, baseline=not args.no_baseline)
            report = {"side_by_side": vllm_engine.side_by_side(ours, report), "hf": ours, "vllm": report}
            text = vllm_engine.summary(report)
    out = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(out + "\n")
    else:
        print(out)
    print(text + (f"\nreport in {args.out}" if args.out else ""), file=sys.stderr)
    return 0
