"""DFlash2's pieces against speculators 0.9.0 itself (issue #39: the loop twin of tests/oracles.py checked once
against the wheel): the convolution, the training candidates, the candidate scores and the selector's loss (decay and
D-PACE) on the same random float64 tensors; and the unary loss under D-PACE, the weighting of the DSpark and DFlash2
defaults (`loss.kind=kl`, `loss.weighting=dpace`), against its losses/utils.py (issue #39: which confidence).
speculators is not a dependency; read its wheel unpacked:

    pip download speculators==0.9.0 --no-deps -d /tmp/spec && unzip -q /tmp/spec/*.whl -d /tmp/spec/whl
    python scripts/dflash2_wheel_check.py /tmp/spec/whl

Its package __init__ files import its whole stack (openai, vLLM clients, ...): the packages on the path to
models/dflash2 are stood in by empty modules, so that only the files compared here (and what they import) load.
"""
import sys
import types

import torch

PACKAGES = ("", ".models", ".models.dflash", ".models.dflash2", ".models.dspark")


def import_reference(wheel_dir: str):
    for suffix in PACKAGES:
        module = types.ModuleType("speculators" + suffix)
        module.__path__ = [wheel_dir + "/speculators" + suffix.replace(".", "/")]
        sys.modules["speculators" + suffix] = module
    from speculators.models.dflash2 import metrics, model_definitions

    return model_definitions, metrics


def main(wheel_dir: str) -> None:
    from dflash_fast.drafter.conv import grouped_dynamic_conv
    from dflash_fast.drafter.dflash2 import CandidateSelector, selector_loss, training_candidates
    from dflash_fast.drafter.losses import DPace

    ref, ref_metrics = import_reference(wheel_dir)
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)
    b, h, group, taps, a = 4, 24, 8, 3, 3
    x, delta, base = rand(1, a * b, h), rand(1, a * b, taps, h // group), rand(taps, h)
    diff = grouped_dynamic_conv(x, delta, base, b, group) - ref.grouped_dynamic_conv(
        x, delta, base, block_size=b, group_size=group)
    print(f"convolution: max |ours - speculators| = {diff.abs().max():.3g}")

    v, rank, k, n = 50, 6, 5, a * b
    theirs = ref.CandidateSelector(vocab_size=v, hidden_size=h, rank=rank, top_k=k).double()
    with torch.no_grad():  # weights that make the transition matter (its init is std 0.02)
        for p in theirs.parameters():
            p.copy_(0.5 * rand(*p.shape))
    ours = CandidateSelector(v, h, rank, k).double()
    ours.load_state_dict(theirs.state_dict())
    hidden, lm_head = rand(n, h), rand(v, h)
    unary = hidden @ lm_head.T
    prev = torch.randint(0, v, (n,), generator=gen)
    top = unary.topk(k, -1).indices
    label = torch.randint(0, v, (n,), generator=gen)
    label[::2] = top[::2, 2]  # half the slots have their label among the candidates
    want = ref_metrics.selector_training_candidates(top[None], label[None])
    got = training_candidates(top, label)
    print("training candidates, label index, contains equal:", [torch.equal(w[0], g) for w, g in zip(want, got)])
    want_scores = theirs.score_candidates(unary[None], hidden[None], prev[None], want[0])[0]
    got_scores = ours.scores(hidden, lm_head, prev, got[0])
    print(f"candidate scores: max |ours - speculators| = {(want_scores - got_scores).abs().max():.3g} (ours: fp32)")
    mask = torch.ones(n)
    mask[::b] = 0
    mask[5] = 0
    j = torch.arange(n) % b
    decay = torch.where(j >= 1, torch.exp(-(j - 1) / 3.0), torch.zeros(())) * mask
    for weighting, weights, dpace in (("fixed-exp-decay", decay, None), ("dpace", mask, DPace(0.3, b))):
        want_loss = ref_metrics.compute_selector_loss(want_scores[None], want[1], mask[None].double(), b, gamma=3.0,
                                                      per_position_loss_weight=weighting, dpace_alpha=0.3)
        got_loss = selector_loss(ours, hidden, lm_head, prev, top, label, weights, mask.sum(), dpace).loss.detach()
        print(f"selector loss, {weighting}: speculators {want_loss.item():.7f}, ours {got_loss.item():.7f}")
    unary_dpace(gen, n, b, mask, j)


def unary_dpace(gen: torch.Generator, n: int, b: int, mask: torch.Tensor, j: torch.Tensor, alpha: float = 0.3) -> None:
    """The unary loss under D-PACE against speculators' dpace_loss_decay (losses/utils.py). Its confidence is
    exp(-elementwise loss) of the loss it weights; its trainer accepts D-PACE only with --loss-fn ce
    (train/config/schema.py `_validate_dpace`), where that is exp(-CE) against the teacher argmax, ours (spec.md §5)
    for every kind. For `kl` (our DSpark and DFlash2 default, refused by its trainer) the script shows both: our
    gradient equals its KL weighted by the CE confidence, and differs from its function fed the KL."""
    from functools import partial

    from speculators.losses import dpace_loss_decay, loss_function
    from speculators.losses.eager import ce_loss, kl_div_loss  # its utils' are the fused (GPU) ones

    from dflash_fast.drafter.eager import lm_head_loss
    from dflash_fast.drafter.losses import DPace, Teacher

    v, h = 41, 16
    last, lm_head = torch.randn(n, h, generator=gen, dtype=torch.float64), torch.randn(v, h, generator=gen,
                                                                                      dtype=torch.float64)
    # a drafter near its teacher: confidences spread over (0, 1), where exp(-KL) and exp(-CE) part
    hidden = (last + 0.3 * torch.randn(n, h, generator=gen, dtype=torch.float64)).requires_grad_(True)
    norm = lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    logits, targets = lambda: (norm(hidden) @ lm_head.T)[None], (norm(last) @ lm_head.T)[None]
    pos, m = j[None].double(), mask[None].double()
    ce_confidence = lambda pos_idx, elementwise_loss: dpace_loss_decay(  # noqa: ARG005 (its decay_fn's signature)
        pos_idx, m, b, alpha, elementwise_loss=ce_loss(logits(), targets).detach() * m)
    teacher = Teacher(last=last, final_norm_weight=torch.ones(h, dtype=torch.float64))
    for kind, fn in (("ce", ce_loss), ("kl", kl_div_loss)):
        ours = lm_head_loss(hidden, torch.ones(h, dtype=torch.float64), lm_head, mask.double(), kind, mask.sum(),
                            1e-6, teacher, DPace(alpha, b))
        got = torch.autograd.grad(ours.loss, hidden)[0]
        theirs = {"exp(-CE)": ce_confidence,
                  "exp(-loss)": partial(dpace_loss_decay, loss_mask=m, block_size=b, dpace_alpha=alpha)}
        for name, decay_fn in theirs.items():
            theirs_loss = loss_function(logits(), targets, m, pos, loss_fn=fn, decay_fn=decay_fn)
            want = torch.autograd.grad(theirs_loss, hidden)[0]
            err = (got.double() - want).abs().max() / want.abs().max()
            print(f"unary {kind} + D-PACE: d loss / d h, ours against speculators with confidence {name}: "
                  f"max relative difference {err:.3g}")


if __name__ == "__main__":
    main(sys.argv[1])
