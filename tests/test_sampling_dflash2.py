"""DFlash2's selector sampled at T > 0 (spec.md §9-10), as vLLM 0.32 drafts it (v1/worker/gpu/spec_decode/dflash2
`_selector_walk_kernel` + `_cache_draft_logits_kernel`): slot by slot, a Gumbel-max draw from softmax(score / T) over
the slot's K unary candidates, the next slot's `prev` the candidate drawn; q handed to the rejection sampler is that
softmax (the scores at the candidates' ids, -inf elsewhere). The chi-square check is tests/test_sampling.py's."""
import pytest
import torch
from test_dflash2 import dflash2_drafter
from test_drafter import V, random_batch
from test_sampling import chi_square, matches

from dflash_fast.evaluate.sampling import DraftSampler, verify

T_HOT = 20.0  # scores span tens here: hot enough that the draws leave the greedy chain


def hot_drafter(sample_from_anchor):
    d = dflash2_drafter(sample_from_anchor).eval()
    with torch.no_grad():
        d.candidate_selector.successor_codebook.mul_(5)  # transitions that outweigh the unary gaps: prev decides
    batch = random_batch(t=24, anchors=((9,),), valid=((True,),))
    return d, batch["hidden"][0, :9], int(batch["input_ids"][0, 9])


def walk_scores(d, hidden, anchor, drafts):
    """The loops' reading of spec.md §9 for the drafts of one block: per drafted slot, its unary top-K ids [K] and the
    selector's scores [K] with prev = the token drafted before it (the anchor's first)."""
    shift, first = int(d.config.sample_from_anchor), d.config.first_slot
    ctx = d.context(hidden[None])
    anchors = torch.tensor([[hidden.shape[0]]])
    x = d.block_states(ctx, torch.arange(hidden.shape[0])[None], torch.tensor([[anchor]]), anchors, anchors,
                       torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, hidden.shape[0], dtype=torch.long))
    h = d.norm(x[0])
    tokens = [anchor] + drafts.tolist()  # tokens[m]: the token at position T + m
    out = []
    for k in range(first, d.config.block_size):
        ids = (h[k] @ d.lm_head.T).topk(d.candidate_selector.top_k).indices
        prev = tokens[k + shift - 1]
        s = d.candidate_selector
        scores = h[k] @ d.lm_head[ids].T + (s.predecessor_codebook[prev] * s.hidden_projection(h[k])) @ \
            s.successor_codebook[ids].T
        out.append((ids, scores))
    return out


def sampled_off_greedy(d, hidden, anchor, temperature):
    """(the greedy drafts, a sampled block whose walk leaves the greedy one before its last slot, its q [k, V]) of
    `d.propose` with our evaluator's DraftSampler at `temperature` (fails when 50 draws never leave it: vacuous)."""
    draw = DraftSampler(temperature, torch.Generator().manual_seed(1))
    greedy = d.propose(hidden, anchor)
    for _ in range(50):
        drafts = d.propose(hidden, anchor, draw=draw)
        q = draw.take(drafts.tolist(), V, "cpu")
        if not torch.equal(drafts[:-1], greedy[:-1]):
            break
    assert not torch.equal(drafts[:-1], greedy[:-1]), "the sampled chain is the greedy one: vacuous"
    return greedy, drafts, q


@pytest.mark.parametrize("sample_from_anchor", [True, False], ids=["from_anchor", "dflash_alignment"])
def test_q_of_each_slot_is_the_selector_softmax_over_its_candidates_given_the_token_drawn_before(sample_from_anchor):
    """The chain must leave the greedy one before its last slot, so that a later slot's prev is a sampled token."""
    d, hidden, anchor = hot_drafter(sample_from_anchor)
    with torch.no_grad():
        greedy, drafts, q = sampled_off_greedy(d, hidden, anchor, T_HOT)
        expected = torch.zeros_like(q)
        for j, (ids, scores) in enumerate(walk_scores(d, hidden, anchor, drafts)):
            expected[j, ids] = torch.softmax(scores / T_HOT, -1)
        # a draw that takes each row's argmax is the greedy walk
        assert torch.equal(d.propose(hidden, anchor, draw=lambda row: row.argmax(-1)), greedy)
    torch.testing.assert_close(q, expected, atol=1e-6, rtol=1e-5)
    assert ((q > 0).sum(-1) == d.candidate_selector.top_k).all(), "q lives on the K candidates only"


def selector_blocks(trials, seed, broken_q=False):
    """Blocks drafted by the DFlash2 walk at T_HOT and verified against a fixed p [k+1, V] (context-blind, different
    from q): counts [k+1, V] of the token emitted at each block position (tests/test_sampling.emitted_counts), and
    counts [V] of the first draft (what q[0] must match). broken_q: the verifier is handed softmax(score) instead of
    softmax(score / T) (the temperature left out of q: q^T renormalised), the drafts still drawn at T. (q one-hot at
    the drafts would not be a broken rule: that is vLLM's greedy q, lossless for any draft.)"""
    d, hidden, anchor = hot_drafter(False)
    k = d.config.block_size - d.config.first_slot
    g = torch.Generator().manual_seed(seed)
    draw = DraftSampler(T_HOT, g)
    with torch.no_grad():  # p overlaps one sampled chain's q (drafts get accepted) and is not q (rejections happen)
        q_chain = draw.take(d.propose(hidden, anchor, draw=draw).tolist(), V, "cpu")
    p = torch.softmax(1.5 * torch.randn(k + 1, V, generator=g), -1)
    p[:k] = 0.7 * q_chain + 0.3 * p[:k]
    counts, first = torch.zeros(k + 1, V, dtype=torch.long), torch.zeros(V, dtype=torch.long)
    q0 = None
    with torch.no_grad():
        for _ in range(trials):
            drafts = d.propose(hidden, anchor, draw=draw).tolist()
            q = draw.take(drafts, V, "cpu")
            q0 = q[0] if q0 is None else q0
            first[drafts[0]] += 1
            if broken_q:
                q = q**T_HOT / (q**T_HOT).sum(-1, keepdim=True)
            n, token = verify(drafts, q, p, g)
            for j in range(n):
                counts[j, drafts[j]] += 1
            counts[n, token] += 1
    return p, counts, first, q0


def test_sampled_selector_drafts_verified_against_their_q_emit_the_target_distribution():
    p, counts, first, q0 = selector_blocks(trials=1500, seed=3)
    assert matches(first, q0), "the first draft is not distributed as the recorded q"
    reached = [j for j in range(p.shape[0]) if counts[j].sum() >= 100]
    assert reached[:3] == [0, 1, 2], "too few drafts accepted: the later positions are barely tested"
    for j in reached:
        stat, limit = chi_square(counts[j], p[j])
        assert stat <= limit, f"position {j}: chi-square {stat:.1f} > {limit:.1f} over {int(counts[j].sum())} tokens"


def test_the_check_rejects_a_q_without_the_temperature():
    p, counts, _, _ = selector_blocks(trials=1500, seed=3, broken_q=True)
    stat, limit = chi_square(counts[0], p[0])
    assert stat > limit, f"q = softmax(score) for drafts drawn at T passed the check (chi-square {stat:.1f})"
