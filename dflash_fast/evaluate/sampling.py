"""Speculative sampling at temperature T > 0 (spec.md §10): the lossless accept / reject / residual / bonus rule.

    p = target_probs(target logits)   softmax(logits / T), then top-p: the target's own sampling distribution
    q = draft_probs(drafter logits)   softmax(logits / T), no top-p (vLLM drafts this way: it "does not affect the
                                      distribution of the generated tokens after rejection sampling")
    for j = 1..k, draft x_j:  accept with probability min(1, p_j(x_j) / q_j(x_j))
    first rejection at j:     emit a token drawn from normalise(max(0, p_j - q_j)) and stop
    all k accepted:           emit a bonus token drawn from p_{k+1}

Whatever q is, every emitted token is distributed as p given the tokens before it (Leviathan et al. 2023), so
sampled speculative output has the target's own sampling distribution. A proposer that drafts deterministically
(argmax, a scripted proposer) has q one-hot at its token: accept with probability p(x), the residual is p with x
removed — vLLM's `draft_sample_method="greedy"`.

Where q comes from, as vLLM 0.32 takes it (draft_sample_method="probabilistic"): DFlash samples every slot of the
block from its tempered softmax in one pass (v1/spec_decode/llm_base_proposer.py `_sample_from_logits`,
v1/worker/gpu/spec_decode/speculator.py); DSpark walks its block slot by slot, each slot's Markov bias from the token
sampled at the slot before, q the tempered softmax of the biased logits (v1/worker/gpu/spec_decode/dspark/speculator.py
`_sample_sequential`). The drafter's `propose(..., draw=DraftSampler)` does both; `DraftSampler` records each q.

One `torch.Generator` (on the target's device, seeded once per evaluation) drives every draw, so a report is
reproducible for a given seed, prompt order and device.
"""
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from dflash_fast.errors import ConfigError


class Sampling(NamedTuple):
    """The sampling settings of an evaluation: temperature 0 is greedy (spec.md §6's exact rule, top_p unused)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def add_sampling_arguments(p) -> None:
    """`--temperature`, `--top-p`, `--seed` of `dflash-fast eval` (both engines)."""
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples, verified by the lossless rule (spec.md §10)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass of the target's sampling (default 1: off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")


def check_sampling(temperature: float, top_p: float, seed: int = 0) -> Sampling:
    """The flags checked once at the edge -> Sampling."""
    if not 0 <= temperature < float("inf"):
        raise ConfigError(f"--temperature {temperature}: must be a finite number >= 0 (0 = greedy, 1 = the target's "
                          f"own softmax)")
    if not 0 < top_p <= 1:
        raise ConfigError(f"--top-p {top_p}: must be in (0, 1] (1 = off)")
    if temperature == 0 and top_p < 1:
        raise ConfigError(f"--top-p {top_p} with --temperature 0: greedy decoding has no nucleus; pass "
                          f"--temperature > 0 to sample, or leave --top-p out")
    return Sampling(float(temperature), float(top_p), int(seed))


def draft_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """q: logits [..., V] -> softmax(logits / T) [..., V] in fp32 (vLLM's draft distribution: temperature only)."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def target_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """p: logits [..., V] -> the target's sampling distribution [..., V] in fp32: softmax(logits / T) restricted to
    the nucleus (the fewest most likely tokens whose mass reaches top_p; the most likely one always kept) and
    renormalised, as vLLM's apply_top_k_top_p and HF's TopPLogitsWarper keep it."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1:
        return probs
    ordered, order = probs.sort(dim=-1, descending=True)
    keep = ordered.cumsum(-1) - ordered < top_p  # the mass before a token is below top_p: it is in the nucleus
    kept = torch.zeros_like(probs).scatter(-1, order, ordered * keep)
    return kept / kept.sum(-1, keepdim=True)


def accept_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)) for the drafted token x; 0 where q(x) = 0 (a token the drafter could not draw)."""
    return torch.where(q_x > 0, (p_x / q_x.clamp_min(torch.finfo(q_x.dtype).tiny)).clamp(max=1), 0.0)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalise(max(0, p - q)) [V] for p, q [V]: what a rejected slot draws from. Its mass is the rejection
    probability, sum_x max(0, q(x) - p(x)) > 0 whenever a rejection can happen; p itself where rounding left none."""
    r = (p - q).clamp_min(0)
    total = r.sum()
    return r / total if total > 0 else p


class Verdict(NamedTuple):
    accepted: int  # n: the drafts 1..n were accepted
    token: int  # the token emitted after them: a residual draw at slot n + 1, or the bonus token when n = k


def verify(drafts: Sequence[int], q: torch.Tensor, p: torch.Tensor, generator: torch.Generator) -> Verdict:
    """The lossless rule over one block: drafts [k], q [k, V] (the distribution each draft was drawn from), p [k+1, V]
    (the target's sampling distribution at each drafted position and after the last) -> Verdict."""
    k = len(drafts)
    if q.shape[0] != k or p.shape[0] != k + 1:
        raise ValueError(f"verify: {k} drafts need q [{k}, V] and p [{k + 1}, V], got {list(q.shape)} and "
                         f"{list(p.shape)}")
    x = torch.tensor(list(drafts), dtype=torch.long, device=p.device)
    rows = torch.arange(k, device=p.device)
    u = torch.rand(k, generator=generator, device=p.device)
    accept = u < accept_probability(p[rows, x], q[rows, x])
    n = int(accept.long().cumprod(0).sum())  # one host sync per block
    dist = p[k] if n == k else residual(p[n], q[n])
    return Verdict(n, int(torch.multinomial(dist, 1, generator=generator)))


def one_hot(tokens: Sequence[int], vocab_size: int, device) -> torch.Tensor:
    """q of a deterministic proposer: [k, V] with 1 at each drafted token."""
    q = torch.zeros(len(tokens), vocab_size, device=device)
    q[torch.arange(len(tokens), device=device), torch.tensor(list(tokens), dtype=torch.long, device=device)] = 1
    return q


class DraftSampler:
    """The `draw` a drafter's propose takes at T > 0: logits [n, V] -> tokens [n] drawn from draft_probs, each
    row's q kept (in draw order) until `take` hands the block's q to the verifier."""

    def __init__(self, temperature: float, generator: torch.Generator):
        self.temperature, self.generator = temperature, generator
        self.rows: List[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        q = draft_probs(logits, self.temperature)
        self.rows.append(q)
        return torch.multinomial(q, 1, generator=self.generator)[:, 0]

    def take(self, drafts: Sequence[int], vocab_size: int, device) -> torch.Tensor:
        """q [k, V] of the block just proposed; one-hot at `drafts` when the proposer drew nothing through us."""
        rows, self.rows = self.rows, []
        if not rows:
            return one_hot(drafts, vocab_size, device)
        q = torch.cat(rows)
        if q.shape[0] != len(drafts):
            raise ValueError(f"the proposer drew {q.shape[0]} tokens through the sampler but returned {len(drafts)}")
        return q.to(device)


class Sampler:
    """One evaluation's sampling at T > 0: the generator (seeded once), the target's draws and the block verdicts."""

    def __init__(self, sampling: Sampling, device):
        self.sampling = sampling
        self.generator = torch.Generator(device=device).manual_seed(sampling.seed)
        self.draw = DraftSampler(sampling.temperature, self.generator)

    def p(self, logits: torch.Tensor) -> torch.Tensor:
        return target_probs(logits, self.sampling.temperature, self.sampling.top_p)

    def next_token(self, logits: torch.Tensor) -> int:
        """A token drawn from the target's sampling distribution of logits [V] (plain sampling, the first token)."""
        return int(torch.multinomial(self.p(logits), 1, generator=self.generator))

    def verify_block(self, drafts: Sequence[int], logits: torch.Tensor) -> Tuple[int, int]:
        """The verification forward's logits [k+1, V] over [anchor, drafts] -> (accepted n, the token after them),
        q taken from what the proposer drew for these drafts."""
        q = self.draw.take(drafts, logits.shape[-1], logits.device)
        return verify(drafts, q, self.p(logits), self.generator)


def make_sampler(sampling: Optional[Sampling], device) -> Optional[Sampler]:
    """None for greedy decoding (the evaluator's argmax path, unchanged), else a Sampler on `device`."""
    return None if sampling is None or sampling.greedy else Sampler(sampling, device)
