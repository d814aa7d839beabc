"""Speculative sampling (spec.md §10): the output distribution under speculation is the target's own, and the check that
says so rejects the usual broken rules (always accept; a residual without the max(0, .); a residual that is p).

The check: chi-square of the counts of emitted tokens against the target's probabilities, cells with an expected
count under 5 pooled into one; it fails above the chi-square quantile of false-alarm probability 1e-6 (from torch's
incomplete gamma, no scipy). Every run is seeded, so a pass is reproducible; a correct rule would fail with
probability 1e-6 on a fresh seed.
"""
import functools
import json
import math
import re
from unittest import mock

import pytest
import torch
from tiny_targets import make_tiny_target, tiny_model, write_jsonl

from dflash_fast.cli import main
from dflash_fast.drafter.model import build_drafter
from dflash_fast.errors import ConfigError
from dflash_fast.evaluate import sampling
from dflash_fast.evaluate.decode import TargetRunner, greedy_generate, speculative_generate
from dflash_fast.evaluate.evaluate import evaluate
from dflash_fast.evaluate.sampling import Sampler, Sampling, check_sampling, one_hot, target_probs, verify
from dflash_fast.serve.export import export_drafter

FALSE_ALARM = 1e-6


def chi_square_limit(df: int, alpha: float = FALSE_ALARM) -> float:
    """The chi-square quantile with upper tail `alpha` at `df` degrees of freedom: bisection on the survival function
    Q(df / 2, x / 2) (torch.special.gammaincc, the regularised upper incomplete gamma)."""
    lo, hi = 0.0, 10.0 * df + 100.0
    for _ in range(100):
        mid = (lo + hi) / 2
        tail = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(mid / 2,
                                                                                                 dtype=torch.float64))
        lo, hi = (mid, hi) if tail > alpha else (lo, mid)
    return lo


def chi_square(counts: torch.Tensor, probs: torch.Tensor):
    """counts [C] of draws, probs [C] -> (statistic, the 1e-6 limit), rare cells (expected < 5) pooled."""
    n = counts.sum()
    expected = probs.double() * n
    rare = expected < 5
    obs = torch.cat([counts[~rare].double(), counts[rare].double().sum()[None]])
    exp = torch.cat([expected[~rare], expected[rare].sum()[None]])
    keep = exp > 0
    assert (obs[~keep] == 0).all(), "a draw landed where the target has probability 0"
    obs, exp = obs[keep], exp[keep]
    return float(((obs - exp) ** 2 / exp).sum()), chi_square_limit(len(obs) - 1)


def matches(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    stat, limit = chi_square(counts, probs)
    return stat <= limit


def random_block(seed: int, k: int = 3, vocab: int = 8):
    """p [k+1, V] and q [k, V], peaked and different from each other (a drafter that often disagrees)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(1.5 * torch.randn(k + 1, vocab, generator=g), -1)
    q = torch.softmax(1.5 * torch.randn(k, vocab, generator=g), -1)
    return p, q


def emitted_counts(p: torch.Tensor, q: torch.Tensor, trials: int, seed: int, drafts_from=None) -> torch.Tensor:
    """Blocks of k drafts (drawn from q, or `drafts_from(g)` for a deterministic proposer) verified `trials` times ->
    counts [k+1, V]: row j counts the token emitted at block position j over the blocks that reached it (all drafts
    before j accepted), which must be distributed as p[j]."""
    k, vocab = q.shape
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(k + 1, vocab, dtype=torch.long)
    for _ in range(trials):
        drafts = drafts_from(g) if drafts_from else torch.multinomial(q, 1, generator=g)[:, 0].tolist()
        n, token = verify(drafts, q, p, g)
        for j in range(n):
            counts[j, drafts[j]] += 1
        counts[n, token] += 1
    return counts


def test_chi_square_limit_is_the_tabled_quantile():
    assert round(chi_square_limit(1, 0.05), 2) == 3.84 and round(chi_square_limit(7, 0.01), 2) == 18.48
    assert round(chi_square_limit(1), 2) == 23.93  # chi2.isf(1e-6, 1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampled_drafts_emit_the_target_distribution_at_every_block_position(seed):
    p, q = random_block(seed)
    counts = emitted_counts(p, q, trials=4000, seed=100 + seed)
    for j in range(p.shape[0]):
        stat, limit = chi_square(counts[j], p[j])
        assert stat <= limit, f"position {j}: chi-square {stat:.1f} > {limit:.1f} over {int(counts[j].sum())} tokens"
    assert counts[-1].sum() > 100, "too few blocks accepted every draft: the bonus position is barely tested"


def test_acceptance_is_the_overlap_of_p_and_q_as_tau_measures_it():
    """The emitted distribution is p for any q (even a sampled draft verified as one-hot); what q changes is tau.
    Draft 1 is accepted with probability sum_v min(p_v, q_v): within 5 binomial standard deviations."""
    p, q = random_block(4)
    g = torch.Generator().manual_seed(9)
    trials = 4000
    accepted = sum(verify(torch.multinomial(q, 1, generator=g)[:, 0].tolist(), q, p, g).accepted > 0
                   for _ in range(trials))
    rate = float(torch.minimum(p[0], q[0]).sum())
    assert abs(accepted / trials - rate) < 5 * math.sqrt(rate * (1 - rate) / trials), (accepted / trials, rate)


def test_draft_sampler_hands_the_verifier_the_softmax_each_draft_was_drawn_from():
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    draw = sampling.DraftSampler(0.7, torch.Generator().manual_seed(0))
    drafts = torch.cat([draw(logits[:1]), draw(logits[1:])]).tolist()  # a Markov chain draws slot by slot
    torch.testing.assert_close(draw.take(drafts, 8, "cpu"), torch.softmax(logits / 0.7, -1))
    assert draw.take([4, 5], 8, "cpu").tolist() == one_hot([4, 5], 8, "cpu").tolist(), "nothing drawn: one-hot"


def test_a_deterministic_proposer_has_q_one_hot_and_still_emits_the_target_distribution():
    """vLLM's draft_sample_method="greedy": the argmax drafted, accepted with probability p(x), residual p without x."""
    p, q = random_block(3)
    drafts = q.argmax(-1).tolist()
    counts = emitted_counts(p, one_hot(drafts, q.shape[1], "cpu"), trials=4000, seed=7, drafts_from=lambda _g: drafts)
    for j in range(p.shape[0]):
        assert matches(counts[j], p[j]), f"position {j}"


def always_accept(p_x, _q_x):
    return torch.ones_like(p_x)


def residual_without_max(p, q):
    """max(0, p - q) without the max: p - q has negative entries, no distribution; its magnitude is the nearest
    thing that samples (a sign dropped)."""
    r = (p - q).abs()
    return r / r.sum()


def residual_is_p(p, _q):
    return p


BROKEN = [("accept_probability", always_accept), ("residual", residual_without_max), ("residual", residual_is_p)]
BROKEN_IDS = ["always_accept", "residual_without_max", "residual_is_p"]


@pytest.mark.parametrize("name, broken", BROKEN, ids=BROKEN_IDS)
def test_the_distribution_check_rejects_a_broken_rule(monkeypatch, name, broken):
    p, q = random_block(0)
    monkeypatch.setattr(sampling, name, broken)
    counts = emitted_counts(p, q, trials=4000, seed=100)
    stat, limit = chi_square(counts[0], p[0])
    assert stat > limit, f"{broken.__name__}: the first emitted token passed the check (chi-square {stat:.1f})"


def test_residual_is_the_positive_part_of_p_minus_q_normalised():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.5, 0.1, 0.2])
    torch.testing.assert_close(sampling.residual(p, q), torch.tensor([0.75, 0.0, 0.25, 0.0]))
    torch.testing.assert_close(sampling.residual(p, p), p)  # no mass left (no rejection can happen): p itself


def test_top_p_keeps_the_nucleus_and_renormalises():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).log_softmax(-1)  # temperature 1: these are log-probabilities
    probs = logits.exp()[0]
    got = target_probs(logits, 1.0, top_p=float(probs[0] + probs[1]) - 1e-4)[0]
    want = torch.cat([probs[:2] / probs[:2].sum(), torch.zeros(2)])
    torch.testing.assert_close(got, want)
    assert target_probs(logits, 1.0, top_p=1e-6)[0].tolist() == [1.0, 0.0, 0.0, 0.0], "the top token always stays"
    torch.testing.assert_close(target_probs(logits, 2.0)[0], torch.softmax(logits[0] / 2, -1))


def test_sampling_flags_are_checked_with_the_fix():
    assert check_sampling(1.0, 0.9, 3) == Sampling(1.0, 0.9, 3)
    assert check_sampling(0.0, 1.0).greedy
    bad = [(-1, 1.0, "--temperature -1"), (float("inf"), 1.0, "--temperature inf"),
           (float("nan"), 1.0, "--temperature nan"), (1.0, 0.0, "--top-p 0.0"), (1.0, 1.5, "--top-p 1.5"),
           (0.0, 0.9, "--temperature > 0")]
    for temperature, top_p, words in bad:
        with pytest.raises(ConfigError, match=re.escape(words)):
            check_sampling(temperature, top_p)


# ---------------------------------------------------------------- end to end through the evaluator's loop

V_TINY = 8  # a vocabulary small enough to tabulate the target's exact distribution of its first tokens
B_TINY = 4
TRIALS = 800


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Thousands of tiny forwards: one intra-op thread is 30x faster than two on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = tiny_model("qwen3", num_layers=2, hidden_size=32, vocab_size=V_TINY, seed=3).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(2)  # spread but uneven next-token distributions
    return model


def exact_first_tokens(model, prompt, temperature):
    """P(t1, t2, t3) [V, V, V] of the target's own sampling after `prompt`, by brute force over all prefixes."""
    with torch.no_grad():
        def probs(prefixes):
            return target_probs(model(input_ids=torch.tensor(prefixes)).logits[:, -1], temperature)

        p1 = probs([prompt])[0]
        p2 = probs([prompt + [a] for a in range(V_TINY)])
        p3 = probs([prompt + [a, b] for a in range(V_TINY) for b in range(V_TINY)]).view(V_TINY, V_TINY, V_TINY)
    return p1[:, None, None] * p2[:, :, None] * p3


def drafting_sampler(sampler, drafter_logits):
    """A proposer that samples its B-1 drafts through `sampler.draw` from fixed logits [B-1, V] (context-blind: q
    differs from p, so rejections and residual draws happen)."""
    return lambda _hidden, _anchor, _ids: sampler.draw(drafter_logits)


def first_three(model, propose_for, trials, temperature=1.0, seed=0):
    """counts [V, V, V] of the first three tokens of `trials` speculative runs."""
    runner = TargetRunner(model, [0, 1])
    sampler = Sampler(Sampling(temperature, 1.0, seed), "cpu")
    propose = propose_for(sampler)
    counts = torch.zeros(V_TINY, V_TINY, V_TINY, dtype=torch.long)
    for _ in range(trials):
        tokens = speculative_generate(runner, [1, 2, 3], propose, B_TINY, 3, sampler=sampler).tokens
        counts[tuple(tokens)] += 1
    return counts


def test_speculative_sampling_through_the_evaluator_loop_equals_plain_sampling_from_the_target(tiny):
    """T = 1 on a tiny target: the joint of the first two and of the second and third tokens, against the exact
    table; both the sampled drafts (q their softmax) and the cache rollback after a sampled block are on the path."""
    g = torch.Generator().manual_seed(5)
    drafter_logits = 2 * torch.randn(B_TINY - 1, V_TINY, generator=g)
    counts = first_three(tiny, lambda s: drafting_sampler(s, drafter_logits), TRIALS)
    exact = exact_first_tokens(tiny, [1, 2, 3], 1.0)
    assert matches(counts.sum(2).flatten(), exact.sum(2).flatten()), "(t1, t2)"
    assert matches(counts.sum(0).flatten(), exact.sum(0).flatten()), "(t2, t3)"
    # plain sampling through the same Sampler (the baseline loop at T > 0) draws from the same table
    runner, sampler = TargetRunner(tiny, [0, 1]), Sampler(Sampling(1.0, 1.0, 1), "cpu")
    plain = torch.zeros(V_TINY, V_TINY, V_TINY, dtype=torch.long)
    for _ in range(TRIALS // 2):
        plain[tuple(greedy_generate(runner, [1, 2, 3], 3, sampler=sampler)[0])] += 1
    assert matches(plain.sum(2).flatten(), exact.sum(2).flatten())


@pytest.mark.parametrize("name, broken", BROKEN[:2], ids=BROKEN_IDS[:2])
def test_the_end_to_end_check_rejects_a_broken_rule(tiny, monkeypatch, name, broken):
    monkeypatch.setattr(sampling, name, broken)
    g = torch.Generator().manual_seed(5)
    drafter_logits = 2 * torch.randn(B_TINY - 1, V_TINY, generator=g)
    counts = first_three(tiny, lambda s: drafting_sampler(s, drafter_logits), TRIALS // 4)
    exact = exact_first_tokens(tiny, [1, 2, 3], 1.0)
    assert not matches(counts.sum(2).flatten(), exact.sum(2).flatten()), "(t1, t2) passed the check"


# ---------------------------------------------------------------- drafters: what q is, per family

LAYER_IDS = [1, 3, 5]
B = 4


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("qwen3"))


def scripted_draw(script, seen):
    """A draw that returns the scripted tokens in order and records the logits it was given."""
    it = iter(script)

    def draw(logits):
        seen.append(logits.clone())
        return torch.tensor([next(it) for _ in range(logits.shape[0])])

    return draw


@pytest.mark.parametrize("markov", [False, True], ids=["dflash", "dspark"])
def test_drafts_are_drawn_per_slot_and_a_markov_slot_sees_the_token_drawn_before_it(target, markov):
    """DFlash draws its B-1 slots from one pass's logits; DSpark walks the slots, slot k's biased logits (its q)
    depending on the token drawn at slot k-1 (vLLM's dspark speculator `_sample_sequential`)."""
    torch.manual_seed(0)
    drafter = build_drafter(target, LAYER_IDS, mask_token_id=0, num_layers=1, block_size=B, sample_from_anchor=False,
                            **(dict(markov_rank=8) if markov else {})).eval()
    hidden = torch.randn(6, len(LAYER_IDS), 64)
    with torch.no_grad():
        greedy = drafter.propose(hidden, 5)
        assert torch.equal(drafter.propose(hidden, 5, draw=lambda logits: logits.argmax(-1)), greedy)
        seen_a, seen_b = [], []
        assert drafter.propose(hidden, 5, draw=scripted_draw([7, 8, 9], seen_a)).tolist() == [7, 8, 9]
        drafter.propose(hidden, 5, draw=scripted_draw([7, 20, 9], seen_b))
    rows_a, rows_b = torch.cat(seen_a), torch.cat(seen_b)
    assert rows_a.shape == (B - 1, drafter.config.vocab_size)
    assert len(seen_a) == (B - 1 if markov else 1), "a Markov chain draws slot by slot, DFlash in one pass"
    torch.testing.assert_close(rows_a[:2], rows_b[:2])
    assert not torch.allclose(rows_a[2], rows_b[2]) if markov else torch.equal(rows_a[2], rows_b[2])


@pytest.mark.parametrize("markov", [False, True], ids=["dflash", "dspark"])
def test_eval_at_temperature_one_samples_and_records_the_settings(target, markov):
    torch.manual_seed(0)
    drafter = build_drafter(target, LAYER_IDS, mask_token_id=0, num_layers=1, block_size=B,
                            **(dict(markov_rank=8, confidence_head=True) if markov else {})).eval()
    records = [{"text": "def parse_args(self, args=None):"}, {"text": "class JSONDecoder(object):"}]
    run = lambda seed: evaluate(target, records, drafter, max_new_tokens=12, temperature=1.0, top_p=0.95,
                                seed=seed, progress=False)
    report = run(3)
    assert (report["temperature"], report["top_p"], report["seed"]) == (1.0, 0.95, 3)
    assert report["greedy_mismatches"] is None, "sampled runs are not compared token by token"
    assert all("greedy_match" not in row for row in report["per_prompt"])
    assert report["tau"] >= 1 and sum(report["acceptance_histogram"]) == report["verify_forwards"]
    assert [r["tokens"] for r in run(3)["per_prompt"]] == [r["tokens"] for r in report["per_prompt"]], "seeded"
    greedy = evaluate(target, records, drafter, max_new_tokens=12, progress=False)
    assert greedy["greedy_mismatches"] == 0 and greedy["temperature"] == 0.0


def test_eval_cli_takes_temperature_top_p_and_seed(target, tmp_path):
    torch.manual_seed(0)
    drafter = build_drafter(target, LAYER_IDS, mask_token_id=0, num_layers=1, block_size=B)
    export_drafter(drafter, str(tmp_path / "export"), verifier=target, dtype=torch.float32)
    data = write_jsonl(tmp_path / "p.jsonl", [{"text": "the drafter reads the hidden state of"}])
    out = tmp_path / "eval.json"
    assert main(["eval", "--target", target, "--drafter", str(tmp_path / "export"), "--data", str(data),
                 "--max-new-tokens", "8", "--temperature", "0.7", "--top-p", "0.9", "--seed", "11",
                 "--no-offline", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["temperature"], report["top_p"], report["seed"]) == (0.7, 0.9, 11)
    assert main(["eval", "--target", target, "--drafter", str(tmp_path / "export"), "--data", str(data),
                 "--top-p", "0.9"]) == 2, "--top-p without --temperature is a usage error"


def test_engine_vllm_gets_the_same_sampling_settings_and_samples_its_drafts(target, tmp_path):
    """vLLM itself is not installed here (tests/test_vllm.py runs it): the flags reach evaluate_vllm, and its
    speculative_config asks vLLM to sample drafts from the drafter's softmax (its q) exactly when T > 0."""
    from dflash_fast.cli import command_parser
    from dflash_fast.evaluate import vllm as vllm_engine
    from dflash_fast.evaluate.evaluate import run

    class Called(Exception):
        pass

    seen = {}

    @functools.wraps(vllm_engine.evaluate_vllm)  # call_with_flags reads the real signature through __wrapped__
    def recorder(**kwargs):
        seen.update(kwargs)
        raise Called

    _, parser = command_parser("eval")
    args = parser.parse_args(["--engine", "vllm", "--target", target, "--drafter", str(tmp_path), "--data", "x.jsonl",
                              "--temperature", "1", "--top-p", "0.8", "--seed", "5"])
    with mock.patch.object(vllm_engine, "evaluate_vllm", recorder), pytest.raises(Called):
        run(args)
    assert (seen["temperature"], seen["top_p"], seen["seed"]) == (1.0, 0.8, 5)
    cfg = build_drafter(target, LAYER_IDS, mask_token_id=0, num_layers=1, block_size=B).config
    assert vllm_engine.speculative_config("d", cfg, 1.0)["draft_sample_method"] == "probabilistic"
    assert "draft_sample_method" not in vllm_engine.speculative_config("d", cfg), "greedy: vLLM's default"


@pytest.mark.parametrize("sample_from_anchor", [True, False], ids=["from_anchor", "dflash_alignment"])
@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_dspark_q_of_each_slot_is_its_biased_softmax_given_the_token_sampled_before_it(head_type, sample_from_anchor):
    """The sampled chain fed back as ground truth: the training forward (spec.md §8, its Markov bias from those tokens)
    has each slot's argmax where the recorded q has its mode. A hot temperature makes the draws leave the argmax
    chain, so the bias of every slot must come from the sampled token, not the greedy one."""
    from test_drafter import V as V_SMALL
    from test_drafter import random_batch
    from test_dspark import dspark_drafter

    d = dspark_drafter(head_type, sample_from_anchor)
    with torch.no_grad():
        d.markov_head.markov_w2.weight.mul_(20)  # a bias that outweighs the base logits: the chain decides
    batch = random_batch(t=24, anchors=((9,),), valid=((True,),))
    hidden, anchor = batch["hidden"][0, :9], int(batch["input_ids"][0, 9])
    draw = sampling.DraftSampler(50.0, torch.Generator().manual_seed(1))
    with torch.no_grad():
        drafts = d.propose(hidden, anchor, draw=draw)
        assert not torch.equal(drafts, d.propose(hidden, anchor)), "the sampled chain is the greedy one: vacuous"
    q = draw.take(drafts.tolist(), V_SMALL, "cpu")
    batch["input_ids"][0, 10 : 10 + len(drafts)] = drafts
    out = d(batch, "kl")
    assert torch.equal(q.argmax(-1), out.draft_argmax[0, 0, d.config.first_slot :])
