"""Real block speculative decoding with an HF target and a drafter (spec.md §6), and plain greedy decoding.

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

DSpark drafters (spec.md §8) draft their block as the engines do, slot k's Markov bias from the token drafted
at slot k-1 (DFlashDrafter.propose); with sample_from_anchor they draft B tokens, so a verification block
is B + 1 tokens; with a confidence head a proposal also returns each drafted token's predicted acceptance.

At temperature T > 0 (spec.md §10) the first token and every accepted / replacement / bonus token come from
evaluate/sampling.py's lossless rule instead of the argmax, the drafter sampling its drafts (q) through the same
seeded generator. T = 0 is the greedy loop above, unchanged.
"""

import contextlib
import copy
import inspect
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from dflash_fast.errors import UserError
from dflash_fast.evaluate.sampling import Sampler
from dflash_fast.store.layer_ids import check_layer_ids
from dflash_fast.target.prompts import (
    cut_response,
)
from dflash_fast.target.taps import LayerTaps

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
    id l < L-1 is HF hidden_states[l + 1]; id L-1 is the input of the final norm (spec.md §1-2)."""

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
    sampler: Optional[Sampler] = None,
) -> SpecResult:
    """Block speculative decoding of one prompt, greedy (the loop in this module's docstring) or, with `sampler`,
    by its lossless rule (the proposer draws its drafts through sampler.draw, or its q is one-hot)."""
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 (an anchor and at least one drafted token), got {block_size}")
    t0 = time.perf_counter()
    step = runner.forward(prompt_ids)
    cache, hidden = step.cache, step.hidden
    seq = list(prompt_ids) + [int(step.logits[-1].argmax()) if sampler is None else sampler.next_token(step.logits[-1])]
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
        if sampler is None:
            target = step.logits.argmax(-1).tolist()  # target[j] is the target's token for position T + j + 1
            n = next((j for j in range(block_size - 1) if drafts[j] != target[j]), block_size - 1)
            after = target[n]
        else:
            n, after = sampler.verify_block(drafts, step.logits)
        anchors.append(len(seq) - 1)
        accepted.append(n)
        seq += drafts[:n] + [after]
        hidden = torch.cat([hidden, step.hidden[: n + 1]])
        if not _finished(seq[len(prompt_ids) :], max_new_tokens, eos):
            recomputes += rollback(runner, cache, saved, block, n + 1)
    _sync(runner.device)
    tokens = cut_response(seq[len(prompt_ids) :], max_new_tokens, eos)
    return SpecResult(tokens, accepted, anchors, recomputes, time.perf_counter() - t0, confidence or None)


@torch.inference_mode()
def greedy_generate(
    runner: TargetRunner, prompt_ids: Sequence[int], max_new_tokens: int, eos: Sequence[int] = (),
    sampler: Optional[Sampler] = None,
) -> Tuple[List[int], float]:
    """The target alone, one token per forward with its cache -> (new tokens, seconds); argmax, or drawn by
    `sampler` (plain sampling from the target)."""
    pick = (lambda logits: int(logits.argmax())) if sampler is None else sampler.next_token
    t0 = time.perf_counter()
    step = runner.forward(prompt_ids, taps=False)
    out = [pick(step.logits[-1])]
    while not _finished(out, max_new_tokens, eos):
        step = runner.forward(out[-1:], step.cache, taps=False)
        out.append(pick(step.logits[-1]))
    _sync(runner.device)
    return cut_response(out, max_new_tokens, eos), time.perf_counter() - t0
