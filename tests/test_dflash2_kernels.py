"""DFlash2's unary top-K out of the fused lm_head pass (kernels/lm_head_loss.py `topk_from_tiles`): each row's top-K
read from only the K vocabulary tiles with the largest tile maxima, equal to torch.topk over the whole row, and the
fused pass's ids equal to the eager twin's on shapes where the tile path runs (more tiles than K, a ragged last tile),
its loss and gradients unchanged."""
import pytest
import torch
from dflash_fast.kernels.lm_head_loss import LOGITS_BLOCK_V, topk_from_tiles
from dflash_fast.kernels.lm_head_loss import lm_head_loss as fused

from dflash_fast.drafter import eager

EPS = 1e-6


def tile_maxima(logits):
    """[tiles, C]: what the logits kernel writes as part_max."""
    c, v = logits.shape
    tiles = -(-v // LOGITS_BLOCK_V)
    padded = torch.full((c, tiles * LOGITS_BLOCK_V), float("-inf")).index_copy(1, torch.arange(v), logits)
    return padded.view(c, tiles, LOGITS_BLOCK_V).amax(-1).t()


@pytest.mark.parametrize("c, v, k", [(5, 1000, 3), (6, 2100, 7), (3, 129, 1), (7, 300, 5), (4, 1000, 16)],
                         ids=["8_tiles_k3", "17_tiles_k7", "ragged_tail_k1", "fewer_tiles_than_k", "k_above_tiles"])
def test_top_k_from_the_largest_tile_maxima_is_the_rows_top_k(c, v, k):
    gen = torch.Generator().manual_seed(v + k)
    logits = torch.randn(c, v, generator=gen)
    logits[0, 2 : 2 + k] += 10  # every winner in one tile
    logits[1, -k:] += 10  # every winner in the ragged last tile
    if c > 2:
        logits[2, torch.randperm(v, generator=gen)[:k]] += 10  # winners spread over tiles
    got = topk_from_tiles(logits, tile_maxima(logits), k)
    assert torch.equal(got, logits.topk(k, dim=-1).indices)


@pytest.mark.parametrize("kind, k", [("kl", 3), ("ce", 5)])
def test_fused_unary_top_k_equals_the_eager_twin_where_the_tile_path_runs(kind, k):
    """V = 1000: 8 tiles of 128 (the last one 104 ids), more than K, in chunks of 16 rows under the interpreter."""
    gen = torch.Generator().manual_seed(5)
    n, h, v, u = 37, 24, 1000, 11
    x, w = torch.randn(n, h, generator=gen), torch.randn(v, h, generator=gen)
    teacher = eager.Teacher(last=torch.randn(u, h, generator=gen), final_norm_weight=torch.ones(h),
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
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    for g, wg in zip(got_grads, want_grads):
        torch.testing.assert_close(g, wg, rtol=1e-4, atol=1e-5)
