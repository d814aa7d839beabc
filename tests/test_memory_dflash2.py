"""DFlash2's terms of the memory model (dflash_fast/train/memory.py: the convolutions in `layer_block_bytes`, the
selector's `selector_bytes` and `selector_backward_bytes`, its parameters in `training_states`) against what a CPU
step allocates, within 10%, measured as tests/test_memory.py measures the other terms (LiveBytes, fp32, the fused
kernels under TRITON_INTERPRET=1)."""
import dataclasses
import math

import pytest
import torch
from test_memory import SETUP, STATES, A, B, H, LiveBytes, T, V, batch, config, within

from dflash_fast.drafter import ops
from dflash_fast.drafter.model import DFlashDrafter
from dflash_fast.drafter.weights import trainable_shapes
from dflash_fast.train.memory import (
    Setup,
    Step,
    layer_block_bytes,
    layer_context_bytes,
    selector_backward_bytes,
    selector_bytes,
    step_memory,
    training_states,
)

Q = A * B


def dflash2_config(layers: int, taps: int = 0, rank: int = 0, top_k: int = 4):
    return dataclasses.replace(config(layers), conv_kernel_size=taps, conv_group_size=16, selector_rank=rank,
                               selector_top_k=top_k)


def measure(cfg):
    """(live after the forward, the forward's peak, the most the backward holds beyond the forward's end)."""
    torch.manual_seed(0)
    d = DFlashDrafter(cfg)
    d.set_frozen(torch.randn(V, H), torch.randn(V, H), torch.ones(H))
    for p in d.parameters():
        p.grad = torch.zeros_like(p)  # a later step's gradients: there before the forward
    with ops.backend("triton"):
        live = LiveBytes()
        with live:
            out = d(batch(), loss_kind="kl")
            forward_end, forward_peak = live.live, live.peak
            live.peak = live.live
            out.loss.backward()
    return forward_end, forward_peak, live.peak - forward_end


@pytest.mark.parametrize("taps", [1, 2])
def test_a_dflash2_layers_saved_tensors_match_the_model(taps):
    """Per layer on the fused path (the convolutions' kernel): 6 [Q, H] and the two kernel projections' outputs
    [Q, 2 taps H / group] on top of DFlash's, whatever the taps (the torch twin's (8 taps + 2) [Q, H] would fail)."""
    ends = [measure(dflash2_config(n, taps=taps))[0] for n in (1, 2)]
    cfg = dflash2_config(1, taps=taps)
    within(ends[1] - ends[0], layer_block_bytes(cfg, Q, 4) + layer_context_bytes(cfg, T, 4), "a DFlash2 layer")
    assert layer_block_bytes(cfg, Q, 4) - layer_block_bytes(config(1), Q, 4) == (6 * Q * H + 4 * Q * taps * H // 16) * 4


@pytest.mark.parametrize("top_k", [2, 8])
def test_the_selectors_saved_tensors_match_the_model_without_a_candidate_gather(top_k):
    """The selector's saved tensors on the fused path grow by [Q, r] codes a candidate, never by [Q, K, H] rows
    (the candidates' unary logits come from the lm_head pass)."""
    dflash = measure(config(1))[0]
    cfg = dflash2_config(1, rank=8, top_k=top_k)
    within(measure(cfg)[0] - dflash, selector_bytes(cfg, Q, 4), f"the selector's saved tensors, K = {top_k}")
    assert selector_bytes(config(1), Q, 4) == 0


def test_the_selectors_backward_holds_both_codebook_gradients():
    """At r = 128 the two [V, r] index gradients of the codebooks are the backward's largest moment."""
    cfg = dflash2_config(1, rank=128)
    within(measure(cfg)[2], selector_backward_bytes(cfg, 4), "the selector's backward")


def test_a_dflash2_steps_peak_matches_the_model():
    cfg = dflash2_config(2, taps=2, rank=64, top_k=4)
    forward_end, forward_peak, backward_peak = measure(cfg)
    plan = step_memory(cfg, Step(T, A), SETUP)
    assert "DFlash2 selector (saved)" in plan.resident and "DFlash2 selector's backward" in plan.transient
    within(max(forward_peak, forward_end + backward_peak), plan.peak - sum(plan.resident[k] for k in STATES),
           "a DFlash2 step's peak")


def test_dflash2_parameters_and_optimizer_states_match_the_model():
    """The convolutions' and the selector's parameters in the weights and AdamW's states; Muon (DeepSpeed's
    use_muon: two or more dimensions) keeps one momentum on the [2, taps, H] base kernels and the [V, r] codebooks."""
    cfg = dflash2_config(2, taps=2, rank=8)
    torch.manual_seed(0)
    d = DFlashDrafter(cfg)
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad])
    for p in d.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    states = training_states(cfg, SETUP)
    held = sum(s.numel() * s.element_size() for st in opt.state.values() for s in st.values() if s.dim())
    within(held, states["optimizer states"], "AdamW's states")
    within(sum(p.numel() * 4 for p in d.parameters() if p.requires_grad), states["weights"], "the weights")
    shapes = trainable_shapes(cfg)
    params = sum(math.prod(s) for s in shapes.values())
    matrices = sum(math.prod(s) for s in shapes.values() if len(s) >= 2)
    assert any(len(s) == 3 for s in shapes.values())  # the base kernels
    assert training_states(cfg, Setup(optimizer="muon"))["optimizer states"] == (4 * params + 4 * matrices
                                                                                 + 8 * (params - matrices))
