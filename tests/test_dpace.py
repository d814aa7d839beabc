"""D-PACE position weights (spec.md §5): the weights of a hand-computed block, the eager loss that uses them,
and the drafter's `weighting="dpace"`. The fused kernel is compared with the eager loss in
tests/test_kernel_lm_head_loss.py; the trainer's wiring in tests/test_trainer.py."""
import pytest
import torch
import torch.nn.functional as F

from dflash_fast.drafter import eager
from dflash_fast.drafter.losses import DPace, Teacher, dpace_weights


def test_weights_of_a_hand_computed_block():
    # Block 1: slots 1..3 trained with confidences 0.5, 0.8, 0.25; alpha 0.5 -> s = 0.75, 0.9, 0.625,
    # P = 0.75, 0.675, 0.421875, w_j = sum_{i >= j} P_i. Block 2: slot 2 untrained, so s_2 = 1 and it
    # adds nothing to the suffix sums, and slot 0 (always untrained) has weight 0 in both.
    confidence = torch.tensor([0.9, 0.5, 0.8, 0.25, 0.9, 0.5, 0.1, 0.25])
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 0, 1], dtype=torch.bool)
    got = dpace_weights(confidence, mask, DPace(0.5, 4))
    expected = torch.tensor([0, 0.75 + 0.675 + 0.421875, 0.675 + 0.421875, 0.421875, 0, 0.75 + 0.46875, 0, 0.46875])
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("alpha,expected", [(1.0, [0.0, 3.0, 2.0, 1.0]), (0.0, [0, 0.5 + 0.4 + 0.1, 0.4 + 0.1, 0.1])])
def test_alpha_one_counts_the_trained_slots_left_and_zero_multiplies_raw_confidences(alpha, expected):
    confidence = torch.tensor([1.0, 0.5, 0.8, 0.25])
    mask = torch.tensor([False, True, True, True])
    torch.testing.assert_close(dpace_weights(confidence, mask, DPace(alpha, 4)), torch.tensor(expected))


def small_loss_inputs(n=12, hid=8, v=11, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return dict(
        h=torch.randn(n, hid, generator=gen).requires_grad_(),
        norm_weight=(1 + 0.1 * torch.randn(hid, generator=gen)).requires_grad_(),
        lm_head_weight=torch.randn(v, hid, generator=gen),
        labels=torch.randint(0, v, (n,), generator=gen),
        mask=torch.tensor([0, 1, 1, 1] * (n // 4), dtype=torch.float32),
    )


def test_eager_ce_loss_is_the_dpace_weighted_mean_of_its_cross_entropies():
    x = small_loss_inputs()
    dpace = DPace(0.5, 4)
    out = eager.lm_head_loss(
        x["h"], x["norm_weight"], x["lm_head_weight"], x["mask"], "ce", x["mask"].sum(), 1e-6,
        Teacher(labels=x["labels"]), dpace,
    )
    logq = F.log_softmax(F.linear(eager.rms_norm(x["h"], x["norm_weight"], 1e-6), x["lm_head_weight"]), -1)
    ce = -logq.gather(1, x["labels"][:, None])[:, 0]
    # By hand, block by block: s_j = (1 - a) e^-CE_j + a on trained slots, w_j = suffix sums of prefix products.
    w = torch.zeros_like(ce)
    for b in range(0, ce.numel(), 4):
        prefix, reach = 1.0, []
        for j in range(b, b + 4):
            if x["mask"][j]:
                prefix = prefix * (0.5 * torch.exp(-ce[j].detach()) + 0.5)
            reach.append(prefix * x["mask"][j])
        for j in range(4):
            w[b + j] = sum(reach[j:]) * x["mask"][b + j]
    torch.testing.assert_close(out.loss, (ce * w).sum() / x["mask"].sum())


def test_dpace_weights_carry_no_gradient():
    x = small_loss_inputs(seed=1)
    args = (x["h"], x["norm_weight"], x["lm_head_weight"])
    teacher = Teacher(labels=x["labels"])
    out = eager.lm_head_loss(*args, x["mask"], "ce", 9.0, 1e-6, teacher, DPace(0.3, 4))
    grads = torch.autograd.grad(out.loss, (x["h"], x["norm_weight"]))
    with torch.no_grad():
        logq = F.log_softmax(F.linear(eager.rms_norm(x["h"], x["norm_weight"], 1e-6), x["lm_head_weight"]), -1)
        confidence = logq.gather(1, x["labels"][:, None])[:, 0].exp()
        fixed = x["mask"] * dpace_weights(confidence, x["mask"] > 0, DPace(0.3, 4))
    ref = eager.lm_head_loss(*args, fixed, "ce", 9.0, 1e-6, teacher)
    torch.testing.assert_close(out.loss, ref.loss)
    for g, r in zip(grads, torch.autograd.grad(ref.loss, (x["h"], x["norm_weight"]))):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("n,alpha", [(10, 0.5), (12, 1.5)])
def test_dpace_refuses_partial_blocks_and_alpha_outside_0_1(n, alpha):
    x = small_loss_inputs(n=12)
    with pytest.raises(ValueError, match="D-PACE needs N"):
        eager.lm_head_loss(
            x["h"][:n], x["norm_weight"], x["lm_head_weight"], x["mask"][:n], "ce", 1.0, 1e-6,
            Teacher(labels=x["labels"][:n]), DPace(alpha, 4),
        )


def test_drafter_dpace_weights_the_mask_by_its_own_confidence_against_the_teacher():
    from test_drafter import B, ce_against_stored_argmax, random_batch, random_drafter

    d = random_drafter()
    batch = random_batch()
    out = d(batch, "ce", weighting="dpace", dpace_alpha=0.25)
    ce, slot_mask = ce_against_stored_argmax(d, batch)
    mask = slot_mask.reshape(-1)
    w = mask * dpace_weights(torch.exp(-ce), mask, DPace(0.25, B))
    assert torch.allclose(out.loss, (ce * w).sum() / mask.sum(), atol=1e-5)
    assert not torch.allclose(out.loss, d(batch, "ce").loss), "the decay and D-PACE losses differ"


@pytest.mark.parametrize(
    "override,message",
    [
        ("loss.weighting=dapce", "loss.weighting='dapce' is not one of"),
        ("loss.dpace_alpha=1.5", r"loss.dpace_alpha=1.5 must be in \[0, 1\]"),
    ],
)
def test_config_refuses_an_unknown_weighting_and_alpha_outside_0_1(override, message):
    from dflash_fast.train.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, ["data.store=/x", override])
