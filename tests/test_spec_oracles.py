"""The eager twins, and the kernels that must equal them, against spec.md written out by hand (tests/oracles.py).

The kernel tests compare each kernel with its eager twin; these tests compare the eager twin (and, on
small shapes, the kernel too) with loops over keys, slots and vocabulary ids that a reader can check
against spec.md line by line, so that a bug shared by twin and kernel cannot pass.
"""
import math

import pytest
import torch
from dflash_fast.kernels.anchored_attention import anchored_attention as attention_kernel
from dflash_fast.kernels.lm_head_loss import lm_head_loss as loss_kernel
from oracles import (
    attention,
    divergence,
    dpace_weight_loops,
    entropy,
    overlap,
    position_weight,
    rms_norm,
    slot_mask,
    soft_cross_entropy,
    teacher_logits,
    topk_cross_entropy,
    topk_self_entropy,
    visible_keys,
)

from dflash_fast.data.batches import sample_anchors
from dflash_fast.drafter import eager, losses
from dflash_fast.drafter.targets import position_weights, slot_targets

BACKENDS = {"eager": (eager.anchored_attention, eager.lm_head_loss), "triton": (attention_kernel, loss_kernel)}
EPS = 1e-6


def device_of(backend):
    """Kernels run on the GPU where there is one (else in the interpreter); the eager twins on the CPU."""
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


# ---------------------------------------------------------------- spec.md §4: the anchored attention pattern

# Two rows of T = 23. Row 0: documents [0, 9) [9, 23); an anchor at a document start (no context), one
# right after it, one invalid (repeating the last valid anchor). Row 1: one document; anchors close
# together so that windows overlap.
T, B = 23, 3
DOCS = ([0] * 9 + [1] * 14, [0] * 23)
ANCHORS = ([0, 9, 10, 17, 17], [2, 6, 7, 15, 21])
VALID = ([1, 1, 1, 1, 0], [1, 1, 1, 1, 1])
PATTERNS = [(None, False, "anchor"), (4, False, "anchor"), (None, True, "anchor"), (2, True, "anchor"),
            (4, False, "query"), (3, True, "query")]
PATTERN_IDS = ["full", "window4", "causal", "window2-causal", "query-window4", "query-window3-causal"]


def spec_masks(window, causal, window_from):
    return [visible_keys(a, v, d, B, window, causal, window_from) for a, v, d in zip(ANCHORS, VALID, DOCS)]


def test_visibility_loops_see_what_spec_says():
    """The oracle itself, on cases read straight off spec.md §4."""
    mask = visible_keys([5, 5], [1, 0], [0] * 2 + [1] * 8, 4, window=2, causal_in_block=True)
    t = 10
    assert mask[0, :t].nonzero().flatten().tolist() == [3, 4], "own document, p < a, p >= a - W"
    assert mask[3, t : t + 4].tolist() == [True] * 4 and mask[0, t : t + 4].tolist() == [True, False, False, False]
    assert not mask[:4, t + 4 :].any(), "another block is invisible"
    assert not mask[4:].any(), "an invalid anchor sees nothing"


def test_a_per_query_window_ends_at_each_slots_own_position():
    """window_from="query": slot j of the block at a sits at a + j and sees the W - 1 keys before it, so the
    context keys a + j - W + 1 .. a - 1 (j + 1 fewer than spec.md §4's a - W .. a - 1)."""
    a, w, b = 9, 5, 4
    mask = visible_keys([a], [1], [0] * 12, b, window=w, window_from="query")
    assert [mask[j, :12].nonzero().flatten().tolist() for j in range(b)] == [[5, 6, 7, 8], [6, 7, 8], [7, 8], [8]]
    spec = visible_keys([a], [1], [0] * 12, b, window=w)
    assert all(spec[j, :12].nonzero().flatten().tolist() == [4, 5, 6, 7, 8] for j in range(b))


@pytest.mark.parametrize("window, causal, window_from", PATTERNS, ids=PATTERN_IDS)
def test_dense_mask_is_the_per_key_visibility_of_spec(window, causal, window_from):
    mask = eager.anchored_attention_mask(
        torch.tensor(ANCHORS), torch.tensor(VALID, dtype=torch.bool), torch.tensor(DOCS), B, window, causal,
        window_from,
    )
    for r, want in enumerate(spec_masks(window, causal, window_from)):
        assert torch.equal(mask[r], want), f"row {r}"


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("window, causal, window_from", PATTERNS, ids=PATTERN_IDS)
def test_attention_is_a_softmax_over_the_keys_spec_makes_visible(backend, window, causal, window_from):
    gen = torch.Generator().manual_seed(0)
    r, a, hq, hkv, d = len(ANCHORS), len(ANCHORS[0]), 4, 2, 16
    q = torch.randn(r, a * B, hq, d, generator=gen)
    k_ctx, v_ctx = torch.randn(r, T, hkv, d, generator=gen), torch.randn(r, T, hkv, d, generator=gen)
    k_blk, v_blk = torch.randn(r, a * B, hkv, d, generator=gen), torch.randn(r, a * B, hkv, d, generator=gen)
    fn, dev = BACKENDS[backend][0], device_of(backend)
    rows = (torch.tensor(ANCHORS), torch.tensor(VALID, dtype=torch.bool), torch.tensor(DOCS))
    tensors = [x.to(dev) for x in (q, k_ctx, v_ctx, k_blk, v_blk, *rows)]
    out = fn(*tensors, B, window, causal, scale=0.3, window_from=window_from).cpu()
    want = attention(q, k_ctx, v_ctx, k_blk, v_blk, spec_masks(window, causal, window_from), scale=0.3)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-5)


# ---------------------------------------------------------------- spec.md §5: slots and weights


@pytest.mark.parametrize("sample_from_anchor", [False, True], ids=["dflash", "dspark_from_anchor"])
@pytest.mark.parametrize("seed", range(4))
def test_slot_mask_is_the_hand_built_mask(seed, sample_from_anchor):
    """Random documents, loss masks and anchors (drawn as batches.py draws them, plus invalid padding); with
    DSpark's sample_from_anchor (spec.md §8) the masks apply to the predicted position p + 1, slot 0 included."""
    gen = torch.Generator().manual_seed(seed)
    r_count, t, a_count, b = 3, 41, 9, 5
    document_ids = torch.stack([torch.randint(0, 4, (t,), generator=gen).sort().values for _ in range(r_count)])
    loss_mask = torch.rand(r_count, t, generator=gen) > 0.3
    drawn = [sample_anchors(loss_mask[r], document_ids[r], a_count, gen) for r in range(r_count)]
    batch = dict(
        input_ids=torch.zeros(r_count, t, dtype=torch.long),
        loss_mask=loss_mask,
        document_ids=document_ids,
        anchors=torch.stack([anchors for anchors, _ in drawn]),
        anchor_valid=torch.stack([valid for _, valid in drawn]),
    )
    batch["anchor_valid"][0, -2:] = False  # padding slots repeating the previous anchors
    want = slot_mask(batch, b, sample_from_anchor)
    assert want.any() and not want.all() and want[..., 0].any() == sample_from_anchor
    assert torch.equal(slot_targets(batch, b, sample_from_anchor).slot_mask, want)


@pytest.mark.parametrize("block_size, gamma", [(16, 7.0), (5, 2.5)])
def test_position_weights_are_spec_values(block_size, gamma):
    want = torch.tensor([position_weight(j, gamma) for j in range(block_size)], dtype=torch.float32)
    torch.testing.assert_close(position_weights(block_size, gamma), want, rtol=1e-6, atol=0)


# ---------------------------------------------------------------- spec.md §5: the loss kinds

N, HIDDEN, VOCAB = 31, 16, 47


def loss_inputs(seed=0, topk=5):
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(N, generator=gen) + 0.5
    weights[::3] = 0  # masked slots
    inputs = dict(
        h=torch.randn(N, HIDDEN, generator=gen),
        norm_weight=1 + 0.1 * torch.randn(HIDDEN, generator=gen),
        lm_head_weight=0.5 * torch.randn(VOCAB, HIDDEN, generator=gen),
        weights=weights,
        last=torch.randn(N, HIDDEN, generator=gen),
        final_norm_weight=1 + 0.1 * torch.randn(HIDDEN, generator=gen),
    )
    teacher = [teacher_logits(x, inputs["final_norm_weight"], inputs["lm_head_weight"], EPS) for x in inputs["last"]]
    t = torch.stack(teacher).float()
    top = t.topk(topk, dim=-1)
    inputs.update(topk_ids=top.indices, topk_logits=top.values, topk_lse=t.logsumexp(-1))
    return inputs


def call(backend, inputs, kind, normalizer=20.0):
    """The backend's loss op on `inputs` -> (LossOutput on the CPU, d loss / d h)."""
    dev = device_of(backend)
    h = inputs["h"].detach().to(dev).requires_grad_()
    keys = {"kl": ("last", "final_norm_weight"), "kl_topk": ("topk_ids", "topk_logits", "topk_lse")}[kind]
    on_dev = {k: inputs[k].to(dev) for k in ("norm_weight", "lm_head_weight", "weights") + keys}
    args = (on_dev.pop("norm_weight"), on_dev.pop("lm_head_weight"), on_dev.pop("weights"), kind, normalizer, EPS)
    out = BACKENDS[backend][1](h, *args, losses.Teacher(**on_dev))
    out.loss.backward()
    return type(out)(*(None if x is None else x.detach().cpu() for x in out)), h.grad.cpu()


def drafter_logits(inputs):
    return rms_norm(inputs["h"], inputs["norm_weight"], EPS) @ inputs["lm_head_weight"].double().T


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_kl_topk_with_k_equal_to_the_vocabulary_is_kl(backend):
    """spec.md §5: the stored top-k teacher is exact in the limit k = V (no rest mass is left)."""
    inputs = loss_inputs(topk=VOCAB)
    full, d_full = call(backend, inputs, "kl")
    topk, d_topk = call(backend, inputs, "kl_topk")
    assert torch.isfinite(topk.loss) and torch.isfinite(topk.kl)
    torch.testing.assert_close(topk.loss, full.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(topk.kl, full.kl, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(d_topk, d_full, rtol=1e-4, atol=1e-6)
    assert torch.equal(topk.teacher_argmax, full.teacher_argmax)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_kl_loss_and_metric_are_soft_cross_entropy_and_it_minus_the_teacher_entropy(backend):
    inputs = loss_inputs()
    out, _ = call(backend, inputs, "kl", normalizer=20.0)
    logits = drafter_logits(inputs)
    loss = kl = 0.0
    for n in range(N):
        teacher = teacher_logits(inputs["last"][n], inputs["final_norm_weight"], inputs["lm_head_weight"], EPS)
        loss += inputs["weights"][n] * soft_cross_entropy(teacher, logits[n])
        kl += inputs["weights"][n] * (soft_cross_entropy(teacher, logits[n]) - entropy(teacher))
    torch.testing.assert_close(out.loss.double(), loss / 20.0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.kl.double(), kl / 20.0, rtol=1e-4, atol=1e-6)
    assert out.kl > 0.1 and out.loss > out.kl, "KL(p||q) >= 0, and the soft CE adds the teacher's entropy"


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_kl_of_a_drafter_equal_to_its_teacher_is_zero(backend):
    inputs = loss_inputs()
    inputs["h"] = inputs["last"].clone()
    inputs["norm_weight"] = inputs["final_norm_weight"]
    out, grad = call(backend, inputs, "kl", normalizer=20.0)
    entropies = sum(
        w * entropy(teacher_logits(x, inputs["final_norm_weight"], inputs["lm_head_weight"], EPS))
        for w, x in zip(inputs["weights"], inputs["last"])
    )
    assert abs(out.kl.item()) < 1e-5
    torch.testing.assert_close(out.loss.double(), entropies / 20.0, rtol=1e-5, atol=1e-6)
    assert grad.abs().max() < 1e-5, "q = p: the soft CE is at its minimum"


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_kl_topk_is_the_hand_written_rest_mass_formula(backend):
    inputs = loss_inputs(topk=5)
    out, grad = call(backend, inputs, "kl_topk", normalizer=20.0)
    h = inputs["h"].detach().double().requires_grad_()
    logits = rms_norm(h, inputs["norm_weight"], EPS) @ inputs["lm_head_weight"].double().T
    loss = kl = 0.0
    for n in range(N):
        stored = inputs["topk_ids"][n], inputs["topk_logits"][n], inputs["topk_lse"][n]
        rest = 1 - sum(math.exp(float(z - stored[2])) for z in stored[1])
        assert rest > 0.05, "the check needs rest mass"
        loss = loss + inputs["weights"][n] * topk_cross_entropy(*stored, logits[n])
        kl = kl + inputs["weights"][n] * (topk_cross_entropy(*stored, logits[n]) + topk_self_entropy(*stored[1:]))
    (loss / 20.0).backward()
    torch.testing.assert_close(out.loss.double(), loss.detach() / 20.0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.kl.double(), kl.detach() / 20.0, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grad.double(), h.grad, rtol=1e-4, atol=1e-6)
    assert torch.equal(out.teacher_argmax, inputs["topk_ids"][:, 0])
    # alpha against the stored teacher: the k ids, then the rest mass as one bucket against 1 - sum_i q_i.
    q = torch.softmax(logits.detach(), -1)
    for n in range(N):
        p = [math.exp(float(z - inputs["topk_lse"][n])) for z in inputs["topk_logits"][n]]
        q_top = [float(q[n, int(v)]) for v in inputs["topk_ids"][n]]
        alpha = sum(min(a, b) for a, b in zip(p, q_top)) + min(1 - sum(p), 1 - sum(q_top))
        assert abs(out.alpha[n].item() - alpha) < 1e-5, (n, out.alpha[n].item(), alpha)


# The dense kinds, against speculators 0.9.0's loss formulas written as loops (tests/oracles.py `divergence`):
# masked slots, D-PACE over blocks of 7 of 35 slots (odd: V = 47, H = 16), fp32 and fp16 inputs (the oracle reads
# the same rounded inputs in float64; the kernel runs under the interpreter on the CPU).
DENSE_CASES = [(torch.float32, False), (torch.float32, True), (torch.float16, True)]
TOL = {torch.float32: dict(loss=1e-5, grad=1e-4, alpha=1e-5), torch.float16: dict(loss=1e-2, grad=3e-2, alpha=1e-2)}


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("dtype,with_dpace", DENSE_CASES)
@pytest.mark.parametrize("kind", ["kl", "tv", "lk", "lk_hybrid", "rkl", "jsd"])
def test_dense_kinds_equal_the_speculators_losses_written_as_loops(backend, kind, dtype, with_dpace):
    n, block, dpace_alpha = 35, 7, 0.3
    gen = torch.Generator().manual_seed(11)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    weights = torch.rand(n, generator=gen) + 0.5
    weights[::3] = 0
    inputs = dict(h=rand(n, HIDDEN), norm_weight=1 + 0.1 * rand(HIDDEN), lm_head_weight=0.5 * rand(VOCAB, HIDDEN),
                  last=rand(n, HIDDEN), final_norm_weight=1 + 0.1 * rand(HIDDEN))
    inputs = {k: v.to(dtype) for k, v in inputs.items()}
    dev = device_of(backend)
    h = inputs["h"].clone().to(dev).requires_grad_()
    dpace = losses.DPace(dpace_alpha, block) if with_dpace else None
    teacher = losses.Teacher(last=inputs["last"].to(dev), final_norm_weight=inputs["final_norm_weight"].to(dev))
    out = BACKENDS[backend][1](h, inputs["norm_weight"].to(dev), inputs["lm_head_weight"].to(dev),
                               weights.to(dev), kind, 20.0, EPS, teacher, dpace)
    out.loss.backward()

    h64 = inputs["h"].double().requires_grad_()
    logits = rms_norm(h64, inputs["norm_weight"], EPS) @ inputs["lm_head_weight"].double().T
    teachers = [teacher_logits(x, inputs["final_norm_weight"], inputs["lm_head_weight"], EPS) for x in inputs["last"]]
    row_weight = weights.double().tolist()
    if with_dpace:  # confidence: the drafter's probability of the teacher's argmax
        confidence = [float(torch.softmax(logits[i].detach(), 0)[teachers[i].argmax()]) for i in range(n)]
        dpace_w = dpace_weight_loops(confidence, weights > 0, dpace_alpha, block)
        row_weight = [w * d for w, d in zip(row_weight, dpace_w)]
    loss = sum(row_weight[i] * divergence(kind, teachers[i], logits[i]) for i in range(n)) / 20.0
    loss.backward()
    alpha = torch.tensor([overlap(teachers[i], logits[i].detach()) for i in range(n)])

    tol = TOL[dtype]
    assert abs(out.loss.item() - loss.item()) <= tol["loss"] * max(1.0, abs(loss.item())), (out.loss.item(), loss)
    grad_err = (h.grad.cpu().double() - h64.grad).abs().max() / h64.grad.abs().max()
    assert grad_err <= tol["grad"], grad_err
    assert (out.alpha.cpu().double() - alpha).abs().max() <= tol["alpha"]
    assert 0.02 < alpha.min() and alpha.max() < 0.95, "the check needs overlaps away from 0 and 1"


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_alpha_against_a_hard_label_is_the_drafters_probability_of_it(backend):
    """ce and ce_data score against a point mass at the label y: alpha = sum_v min([v = y], q_v) = q_y."""
    inputs = loss_inputs()
    labels = torch.randint(0, VOCAB, (N,), generator=torch.Generator().manual_seed(3))
    dev = device_of(backend)
    args = [inputs[k].to(dev) for k in ("h", "norm_weight", "lm_head_weight", "weights")]
    out = BACKENDS[backend][1](*args, "ce_data", 20.0, EPS, losses.Teacher(labels=labels.to(dev)))
    q = torch.softmax(drafter_logits(inputs), -1)
    torch.testing.assert_close(out.alpha.cpu().double(), q[torch.arange(N), labels], rtol=1e-5, atol=1e-6)
