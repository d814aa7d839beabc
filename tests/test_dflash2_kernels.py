"""DFlash2's head on the fused path against its eager twins, on odd shapes: the unary top-K out of the lm_head pass
(kernels/lm_head_loss.py `topk_from_tiles`: each row's top-K read from only the K vocabulary tiles with the largest
tile maxima, equal to torch.topk over the whole row; the pass's ids and logits equal to the eager twin's where the
tile path runs, loss and gradients unchanged), the selector's loss from the pass's unary logits (dflash2
`CandidateUnary`: embedding_bag backward) against the gathered-rows twin, and the Triton RMSNorm with autograd
(kernels/_common.py `rms_norm`, the selector's input on the Triton path) against the eager norm."""
import pytest
import torch
from dflash_fast.kernels._common import rms_norm as triton_rms_norm
from dflash_fast.kernels.lm_head_loss import LOGITS_BLOCK_V, topk_from_tiles
from dflash_fast.kernels.lm_head_loss import lm_head_loss as fused

from dflash_fast.drafter import eager, losses
from dflash_fast.drafter.dflash2 import CandidateSelector, selector_loss
from dflash_fast.target.norm import rms_norm as eager_rms_norm

EPS = 1e-6


def tile_maxima(logits):
    """[tiles, C]: what the logits kernel writes as part_max."""
    c, v = logits.shape
    tiles = -(-v // LOGITS_BLOCK_V)
    padded = torch.full((c, tiles * LOGITS_BLOCK_V), float("-inf")).index_copy(1, torch.arange(v), logits)
    return padded.view(c, tiles, LOGITS_BLOCK_V).amax(-1).t()


@pytest.mark.parametrize("c, v, k", [(5, 1000, 3), (6, 2100, 7), (5, 1024, 3), (6, 17 * 128, 7), (3, 129, 1),
                                     (7, 300, 5), (4, 1000, 16)],
                         ids=["8_tiles_k3", "17_tiles_k7", "8_whole_tiles_k3", "17_whole_tiles_k7", "ragged_tail_k1",
                              "fewer_tiles_than_k", "k_above_tiles"])
def test_top_k_from_the_largest_tile_maxima_is_the_rows_top_k(c, v, k):
    gen = torch.Generator().manual_seed(v + k)
    logits = torch.randn(c, v, generator=gen)
    logits[0, 2 : 2 + k] += 10  # every winner in one tile
    logits[1, -k:] += 10  # every winner in the last tile (ragged or whole)
    if c > 2:
        logits[2, torch.randperm(v, generator=gen)[:k]] += 10  # winners spread over tiles
    got = topk_from_tiles(logits, tile_maxima(logits), k)
    assert torch.equal(got, logits.topk(k, dim=-1).indices)


@pytest.mark.parametrize("kind, k, v", [("kl", 3, 1000), ("ce", 5, 1024)])
def test_fused_unary_top_k_equals_the_eager_twin_where_the_tile_path_runs(kind, k, v):
    """V = 1000: 8 tiles of 128 (the last one 104 ids); V = 1024: 8 whole tiles; more than K, in chunks of 16 rows
    under the interpreter."""
    gen = torch.Generator().manual_seed(5)
    n, h, u = 37, 24, 11
    x, w = torch.randn(n, h, generator=gen), torch.randn(v, h, generator=gen)
    teacher = losses.Teacher(last=torch.randn(u, h, generator=gen), final_norm_weight=torch.ones(h),
                            index=torch.randint(0, u, (n,), generator=gen),
                            labels=torch.randint(0, v, (n,), generator=gen) if kind == "ce" else None)
    weights = torch.rand(n, generator=gen)
    results = []
    for fn in (eager.lm_head_loss, fused):
        inputs = [t.clone().requires_grad_(True) for t in (x, torch.ones(h))]
        out = fn(inputs[0], inputs[1], w, weights, kind, 30, EPS, teacher, topk=k)
        out.loss.backward()
        results.append((out, [t.grad for t in inputs]))
    (want, want_grads), (got, got_grads) = results
    assert torch.equal(got.topk_ids, want.topk_ids)
    torch.testing.assert_close(got.topk_logits, want.topk_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    for g, wg in zip(got_grads, want_grads):
        torch.testing.assert_close(g, wg, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("train_head", [False, True], ids=["frozen_head", "trained_head"])
def test_selector_loss_from_the_passs_unary_logits_equals_the_gathered_rows_twin(train_head):
    """Odd sizes (N = 13, H = 20, V = 53, K = 5, r = 3): the candidates' unary logits taken from the lm_head pass
    (`topk_logits`; the injected label's from its row) and their gradient by embedding_bag give the loss, the draft
    and every gradient of the twin that gathers the K lm_head rows."""
    gen = torch.Generator().manual_seed(7)
    n, h, v, k = 13, 20, 53, 5
    torch.manual_seed(0)
    selector = CandidateSelector(v, h, 3, k)
    hidden, head = torch.randn(n, h, generator=gen), torch.randn(v, h, generator=gen)
    top = (hidden @ head.T).topk(k, dim=-1)
    label = torch.where(torch.arange(n) % 3 == 0, torch.randint(0, v, (n,), generator=gen), top.indices[:, 1])
    prev, weights = torch.randint(0, v, (n,), generator=gen), torch.rand(n, generator=gen)
    results = []
    for topk_logits in (None, top.values):
        selector.zero_grad()
        x, w = hidden.clone().requires_grad_(True), head.clone().requires_grad_(train_head)
        out = selector_loss(selector, x, w, prev, top.indices, label, weights, torch.tensor(n), None, topk_logits)
        out.loss.backward()
        results.append((out, x.grad, w.grad, [p.grad.clone() for p in selector.parameters()]))
    (want, *want_grads), (got, *got_grads) = results
    assert not got.recall.all() and got.recall.any(), "the label is injected for some rows, not all"
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(got.draft, want.draft) and torch.equal(got.hit, want.hit)
    for g, wg in zip(got_grads[:2] + got_grads[2], want_grads[:2] + want_grads[2]):
        if wg is None:
            assert g is None
        else:
            torch.testing.assert_close(g, wg, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [(13, 20), (2, 7, 100)], ids=["13x20", "2x7x100"])
def test_the_triton_rms_norm_with_autograd_equals_the_eager_norm(shape):
    """DFlash2's selector input norm(x) on the Triton path (kernels/_common.py rms_norm): forward, d x and d weight
    of the eager twin, on widths that are no power of two."""
    gen = torch.Generator().manual_seed(11)
    x, weight, dy = torch.randn(shape, generator=gen), torch.rand(shape[-1], generator=gen) + 0.5, torch.randn(shape)
    results = []
    for fn in (eager_rms_norm, triton_rms_norm):
        xi, wi = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        y = fn(xi, wi, EPS)
        y.backward(dy)
        results.append((y.detach(), xi.grad, wi.grad))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
