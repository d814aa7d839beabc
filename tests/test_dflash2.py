"""DFlash2 (spec.md §9): the dynamic convolutions inside each block, the candidate selector and the loss, against
speculators 0.9.0's semantics written out as loops (tests/oracles.py: dflash2_*)."""
import pytest
import torch
from oracles import (
    dflash2_batch_loss,
    dflash2_conv,
    dflash2_scores,
    dflash2_sublayer,
    rms_norm,
    unary_top_k,
)
from test_drafter import B, H, V, proposal_fed_back, random_batch, random_drafter
from test_trainer import tiny  # noqa: F401 (the fixture: a tiny target and its store)

from dflash_fast.drafter import eager, losses, ops
from dflash_fast.drafter.conv import grouped_dynamic_conv
from dflash_fast.drafter.dflash2 import CandidateSelector

EPS = 1e-6
GROUP, TOP_K, RANK = 8, 5, 8
ORACLE_TOP_K = 40  # of V = 96: the random teacher's argmax is among the unary top-K for some slots, not for others
# One document, every block inside the row (speculators never draws an anchor in the last B positions).
ORACLE_BATCH = dict(anchors=((1, 6, 11, 14),), valid=((True, True, True, True),))


def dflash2_drafter(sample_from_anchor=False, taps=2, seed=0, top_k=TOP_K, **kw):
    """A DFlash2 drafter whose convolutions are far from identity and whose selector matters."""
    d = random_drafter(seed, sample_from_anchor=sample_from_anchor, conv_kernel_size=taps, conv_group_size=GROUP,
                       selector_rank=RANK, selector_top_k=top_k, **kw)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in d.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.add_(0.3 * torch.randn(conv.base_kernel.shape, generator=gen))
                conv.kernel_projection.weight.normal_(0, 0.1, generator=gen)
        for p in d.candidate_selector.parameters():
            p.normal_(0, 0.7, generator=gen)
    return d


def oracle_selector(d):
    s = d.candidate_selector
    return dict(P=s.predecessor_codebook, S=s.successor_codebook, W_h=s.hidden_projection.weight)


# ---------------------------------------------------------------- the convolutions


def test_a_fresh_dflash2_equals_dflash():
    """Identity at init (base[0] = 1, the rest and the projection 0): on the same backbone weights the block states
    and the unary logits of a fresh DFlash2 are DFlash's, exactly."""
    dflash = random_drafter(0)
    dflash2 = random_drafter(0, conv_kernel_size=3, conv_group_size=GROUP, selector_rank=RANK, selector_top_k=TOP_K)
    missing, unexpected = dflash2.load_state_dict(dflash.state_dict(), strict=False)
    assert unexpected == [] and all("_conv." in k or k.startswith("candidate_selector.") for k in missing)
    assert len(missing) == 2 * 2 * dflash2.config.num_layers + 3
    dflash2.set_frozen(dflash.embed_tokens, dflash.lm_head, dflash.target_norm)
    batch = random_batch(t=20, **ORACLE_BATCH)
    assert torch.equal(dflash2.batch_states(batch), dflash.batch_states(batch))
    assert torch.equal(dflash2.block_logits(batch)[0], dflash.block_logits(batch)[0])


@pytest.mark.parametrize("taps", [1, 2, 4])
def test_convolution_equals_the_loops_and_never_crosses_a_block_start(taps):
    """Forward and the gradients of x, delta and base; 3 blocks of B = 4 slots, H = 24 in groups of 8."""
    gen = torch.Generator().manual_seed(taps)
    a, h = 3, 24
    x = torch.randn(1, a * B, h, generator=gen, requires_grad=True)
    delta = torch.randn(1, a * B, taps, h // GROUP, generator=gen, requires_grad=True)
    base = torch.randn(taps, h, generator=gen, requires_grad=True)
    got = grouped_dynamic_conv(x, delta, base, B, GROUP)
    want = torch.cat([dflash2_conv(x[0, i : i + B], delta[0, i : i + B], base, GROUP) for i in range(0, a * B, B)])
    torch.testing.assert_close(got[0].double(), want, rtol=1e-6, atol=1e-6)
    grad_out = torch.randn(got.shape, generator=gen)
    mine = torch.autograd.grad(got, (x, delta, base), grad_out)
    theirs = torch.autograd.grad(want, (x, delta, base), grad_out[0].double())
    for name, g, w in zip(("x", "delta", "base"), mine, theirs):
        torch.testing.assert_close(g.double(), w.double(), rtol=1e-5, atol=1e-5, msg=name)
    y = grouped_dynamic_conv(x.detach(), delta.detach(), base.detach(), B, GROUP)
    moved = x.detach().clone()
    moved[0, B - 1] += 1  # the last slot of block 0 reaches no slot of block 1
    assert torch.equal(grouped_dynamic_conv(moved, delta.detach(), base.detach(), B, GROUP)[0, B:], y[0, B:])


def test_each_decoder_layer_convolves_around_both_sublayers():
    """x -> norm -> conv_in -> attention -> conv_out -> + x, the same around the MLP (the layer's own attention, MLP
    and norms, the convolutions from the loops)."""
    d = dflash2_drafter(taps=3)
    layer = d.layers[0]
    gen = torch.Generator().manual_seed(7)
    batch = random_batch(t=20, **ORACLE_BATCH)
    anchors = batch["anchors"]
    x = torch.randn(1, 4 * B, H, generator=gen)
    ctx = torch.randn(1, 20, H, generator=gen)
    blk_pos = (anchors[:, :, None] + torch.arange(B)).view(1, -1)
    blk_cs, ctx_cs = d.rope.cos_sin(blk_pos, x.dtype), d.rope.cos_sin(batch["position_ids"], x.dtype)
    attn = dict(anchors=anchors, anchor_valid=batch["anchor_valid"], document_ids=batch["document_ids"], block_size=B)
    got = layer(x, ctx, d.rope, blk_cs, ctx_cs, attn)

    full = dict(attn, window=None, window_from="anchor", causal_in_block=False)
    attention = lambda y: layer.self_attn(y[None].float(), ctx, d.rope, blk_cs, ctx_cs, full)[0].double()
    mlp = lambda y: layer.mlp(y.float()).double()
    conv = lambda c: (c.kernel_projection.weight, c.base_kernel, B, GROUP)
    x1 = x[0].double() + dflash2_sublayer(rms_norm(x[0], layer.input_layernorm.weight, EPS).float(), attention,
                                          *conv(layer.attention_conv))
    want = x1 + dflash2_sublayer(rms_norm(x1, layer.post_attention_layernorm.weight, EPS).float(), mlp,
                                 *conv(layer.mlp_conv))
    torch.testing.assert_close(got[0].double(), want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the selector and the loss


def test_candidate_scores_and_unary_top_k_equal_the_loops():
    gen = torch.Generator().manual_seed(3)
    n = 7
    selector = CandidateSelector(V, H, RANK, TOP_K)
    with torch.no_grad():
        for p in selector.parameters():
            p.normal_(0, 0.5, generator=gen)
    hidden, lm_head = torch.randn(n, H, generator=gen), torch.randn(V, H, generator=gen)
    prev = torch.randint(0, V, (n,), generator=gen)
    out = eager.lm_head_loss(hidden, torch.ones(H), lm_head, torch.ones(n), "ce", n, EPS,
                             losses.Teacher(labels=torch.zeros(n, dtype=torch.long)), topk=TOP_K)
    unary = rms_norm(hidden, torch.ones(H), EPS) @ lm_head.double().T
    normed = rms_norm(hidden, torch.ones(H), EPS).float()
    scores = selector.scores(normed, lm_head, prev, out.topk_ids)
    sel = dict(P=selector.predecessor_codebook, S=selector.successor_codebook, W_h=selector.hidden_projection.weight)
    for row in range(n):
        assert out.topk_ids[row].tolist() == unary_top_k(unary[row], TOP_K)
        want = dflash2_scores(unary[row], normed[row], int(prev[row]), out.topk_ids[row].tolist(), sel)
        torch.testing.assert_close(scores[row].double(), want, rtol=1e-5, atol=1e-5)


SETTINGS = [("kl", "decay"), ("tv", "decay"), ("ce", "decay"), ("kl", "dpace"), ("ce", "dpace")]


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("sample_from_anchor", [True, False], ids=["from_anchor", "dflash_alignment"])
@pytest.mark.parametrize("kind, weighting", SETTINGS, ids=[f"{k}-{w}" for k, w in SETTINGS])
def test_dflash2_loss_selector_and_gradients_equal_speculators_semantics(kind, weighting, sample_from_anchor, backend):
    """fp32, eager and Triton (the unary top-K from the fused pass, the convolutions' kernel, interpreter): the loss,
    the selector's loss, recall@K, its teacher-forced hits, its serving pick (the draft) and every parameter's
    gradient, against tests/oracles.py's dflash2_batch_loss on the same weights and anchors."""
    d = dflash2_drafter(sample_from_anchor, top_k=ORACLE_TOP_K)
    batch = random_batch(t=20, **ORACLE_BATCH)
    dpace = dict(weighting=weighting, dpace_alpha=0.3)
    with ops.backend(f"lm_head_loss={backend},grouped_dynamic_conv={backend}"):
        out = d(batch, kind, gamma=3.0, selector_alpha=0.7, **dpace)
    out.loss.backward()
    got = {name: p.grad.clone() for name, p in d.named_parameters()}
    d.zero_grad()
    hidden = rms_norm(d.batch_states(batch), d.norm.weight, EPS)
    want, want_selector, slots = dflash2_batch_loss(
        kind, batch, hidden, oracle_selector(d), d.lm_head, B, ORACLE_TOP_K, sample_from_anchor, d.target_norm, EPS,
        0.7, gamma=3.0, dpace_alpha=0.3 if weighting == "dpace" else None)
    want.backward()
    torch.testing.assert_close(out.loss.double(), want.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.selector_loss.double(), want_selector.detach(), rtol=1e-5, atol=1e-6)
    assert len(slots) == int(out.slot_mask.sum()) == (16 if sample_from_anchor else 12)
    for (r, i, j), (_, ids, _, index, contains, pick) in slots.items():
        assert bool(out.recall[r, i, j]) == contains
        assert int(out.teacher_argmax[r, i, j]) == ids[index]
        assert int(out.draft_argmax[r, i, j]) == pick, "the draft is the selector's pick among the unary top-K"
        assert bool(out.selector_hit[r, i, j]) == (contains and pick == ids[index])
    contains = [s[4] for s in slots.values()]
    assert any(contains) and not all(contains), "both the label in the top-K and the label injected are exercised"
    for name, p in d.named_parameters():  # fp32 against float64: the largest error relative to the largest entry
        err = (got[name].double() - p.grad.double()).abs().max() / p.grad.abs().max()
        assert err <= 1e-5, (name, float(err))


def test_the_selector_reaches_the_lm_head_only_through_its_candidates_rows():
    """The selector's gradient reaches the lm_head through the K gathered rows of each slot's training candidates
    (the label injected in row 0), no other row (a trainable lm_head here)."""
    from dflash_fast.drafter.dflash2 import selector_loss, training_candidates

    d = dflash2_drafter()
    gen = torch.Generator().manual_seed(4)
    n = 5
    lm_head = d.lm_head.clone().requires_grad_(True)
    topk = torch.stack([torch.randperm(V, generator=gen)[:TOP_K] for _ in range(n)])
    label = topk[:, 1].clone()
    label[0] = next(v for v in range(V) if v not in topk.flatten().tolist())
    out = selector_loss(d.candidate_selector, torch.randn(n, H, generator=gen), lm_head,
                        torch.randint(0, V, (n,), generator=gen), topk, label, torch.ones(n), torch.tensor(n))
    out.loss.backward()
    candidates = training_candidates(topk, label)[0]
    assert int(candidates[0, -1]) == int(label[0]) and not bool(out.recall[0]) and bool(out.recall[1:].all())
    touched = set(lm_head.grad.abs().sum(-1).nonzero().flatten().tolist())
    assert touched == set(candidates.flatten().tolist())


@pytest.mark.parametrize("kind, dpace", [("kl", None), ("ce", losses.DPace(0.5, 5)), ("kl_topk", None)])
def test_fused_unary_top_k_equals_the_eager_twins_across_chunks(kind, dpace):
    """The Triton pass takes each row's top-K from its chunk's logits (N = 45 rows in chunks of 16 under the
    interpreter, V = 97, K = 7): the ids of the eager twin, whose loss and gradients are unchanged by it, and each
    row's lse (the pass's softmax merge) equal to the eager twin's."""
    from dflash_fast.kernels.lm_head_loss import lm_head_loss as fused

    gen = torch.Generator().manual_seed(3)
    n, h, v, k, u = 45, 24, 97, 7, 19
    x, w = torch.randn(n, h, generator=gen), torch.randn(v, h, generator=gen)
    ids = torch.randint(0, v, (n, 3), generator=gen)
    logits = torch.randn(n, 3, generator=gen).sort(-1, descending=True).values
    teacher = losses.Teacher(last=torch.randn(u, h, generator=gen), final_norm_weight=torch.ones(h),
                            index=torch.randint(0, u, (n,), generator=gen), labels=ids[:, 0] if kind == "ce" else None,
                            topk_ids=ids, topk_logits=logits, topk_lse=logits.logsumexp(-1) + 1)
    results = []
    for fn in (eager.lm_head_loss, fused):
        inputs = [t.clone().requires_grad_(True) for t in (x, torch.ones(h))]
        out = fn(inputs[0], inputs[1], w, torch.rand(n, generator=torch.Generator().manual_seed(0)), kind, 30, EPS,
                 teacher, dpace, topk=k)
        out.loss.backward()
        results.append((out, [t.grad for t in inputs]))
    (want, want_grads), (got, got_grads) = results
    assert got.topk_ids.shape == (n, k) and torch.equal(got.topk_ids, want.topk_ids)
    # each row's lse with its top-K (LiLiCorr's log-probabilities, topk_logits - lse, docs/lilicorr.md)
    lse = torch.logsumexp(eager.rms_norm(x, torch.ones(h), EPS) @ w.T, -1)
    torch.testing.assert_close(want.lse, lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.lse, lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    for g, wg in zip(got_grads, want_grads):
        torch.testing.assert_close(g, wg, rtol=1e-4, atol=1e-5)
    assert fused(x, torch.ones(h), w, torch.ones(n), kind, 30, EPS, teacher, dpace).topk_ids is None


def test_selector_metrics_are_logged_next_to_alpha():
    """recall_at_k over the trained slots; selector_acc over those whose label is among the unary top-K."""
    from dflash_fast.drafter.model import DrafterOutput
    from dflash_fast.train.metrics import Sums

    batch = random_batch(t=20, **ORACLE_BATCH)
    mask = torch.tensor([[[False, True, True, True], [False, True, True, False]]])
    recall = torch.tensor([[[True, True, False, True], [True, True, True, True]]])
    hit = torch.tensor([[[True, True, False, False], [False, False, True, True]]])
    zeros = torch.zeros(1, 2, B, dtype=torch.long)
    out = DrafterOutput(torch.ones(()), None, zeros, zeros, mask, torch.zeros(1, 2, B), selector_loss=torch.ones(()),
                        recall=recall, selector_hit=hit)
    sums = Sums(B, "cpu")
    sums.add_output(out, batch)
    m = sums.metrics(False)
    assert m["recall_at_k"] == pytest.approx(4 / 5) and m["selector_acc"] == pytest.approx(2 / 4)
    assert "alpha_1" in m
    plain = Sums(B, "cpu")
    plain.add_output(random_drafter(0)(batch, "kl"), batch)
    assert "recall_at_k" not in plain.metrics(True)


# ---------------------------------------------------------------- inference: the selector walks the block


@pytest.mark.parametrize("sample_from_anchor", [True, False], ids=["from_anchor", "dflash_alignment"])
def test_propose_walks_the_selector_slot_by_slot(sample_from_anchor):
    """Feeding the drafted tokens back as the ground truth makes the training forward's drafts the proposal."""
    d = dflash2_drafter(sample_from_anchor)
    with torch.no_grad():
        d.candidate_selector.successor_codebook.mul_(5)  # transitions that outweigh the unary gaps: the walk decides
    guess, out, batch = proposal_fed_back(d, sample_from_anchor)
    assert torch.equal(guess, out.draft_argmax[0, 0, d.config.first_slot :])
    unary = d.block_logits(batch)[0][0, d.config.first_slot :].argmax(-1)
    assert not torch.equal(guess, unary), "the selector changed a draft"


# ---------------------------------------------------------------- configuration


def test_dflash2_config_is_checked():
    for kw, what in (
        (dict(conv_kernel_size=2, conv_group_size=5), "does not divide hidden_size"),
        (dict(conv_kernel_size=B + 1), "more taps than the block"),
        (dict(selector_rank=4, selector_top_k=V + 1), "more candidates than the vocabulary"),
        (dict(selector_rank=-1), "selector_rank"),
        (dict(selector_rank=4, markov_rank=4), "choose one family"),
    ):
        with pytest.raises(ValueError, match=what):
            random_drafter(**kw)


def test_dflash2_shapes_are_the_parameters():
    from dflash_fast.drafter.weights import trainable_parameters, trainable_shapes

    d = dflash2_drafter()
    assert trainable_shapes(d.config) == {k: tuple(p.shape) for k, p in d.named_parameters()}
    assert trainable_parameters(d.config) == sum(p.numel() for p in d.parameters())


def test_dflash2_config_keys_are_checked_at_the_edge():
    from dflash_fast.train.config import ConfigError, load_config

    base = ["data.store=x"]
    keys = ["model.conv_kernel_size=2", "model.selector_rank=16", "model.selector_top_k=8", "loss.selector_alpha=0.5"]
    cfg = load_config(None, base + keys)
    options = cfg.model.drafter_options()
    assert (options["conv_kernel_size"], options["selector_rank"], options["selector_top_k"]) == (2, 16, 8)
    assert cfg.loss.selector_alpha == 0.5
    for bad, what in (
        (["model.conv_kernel_size=17"], "more taps than a block"),
        (["model.selector_rank=-2"], "must be >= 0"),
        (["model.selector_rank=4", "model.markov_rank=4"], "two drafter families"),
        (["loss.selector_alpha=-1"], "selector_alpha"),
    ):
        with pytest.raises(ConfigError, match=what):
            load_config(None, base + bad)


# ---------------------------------------------------------------- the trainer


def test_the_trainer_trains_dflash2_and_logs_the_selector_metrics(tiny, tmp_path):  # noqa: F811
    """Two steps of configs/tiny.yaml (AdamW) with DFlash2's keys on the tiny store: recall_at_k and selector_acc in
    metrics.jsonl next to alpha_j, the convolutions trained away from identity, the checkpoint builds the same
    drafter back, and the run ends with an export of speculators' dflash2 type that loads back as the same drafter, as
    does `dflash-fast export --format zlab` of its checkpoint."""
    from test_trainer import TINY_YAML, records, settings

    from dflash_fast.cli import main
    from dflash_fast.serve.export import load_exported, read_export_config
    from dflash_fast.train.checkpoint import load_drafter_for_export
    from dflash_fast.train.config import load_config
    from dflash_fast.train.trainer import train

    out = str(tmp_path / "run")
    keys = dict(model__conv_kernel_size=2, model__conv_group_size=8, model__selector_rank=8,
                model__selector_top_k=16, schedule__steps=2, export="true")
    train(load_config(TINY_YAML, settings(tiny, out, **keys)))
    record = records(out)[-1]
    assert 0 <= record["recall_at_k"] <= 1 and "alpha_1" in record and "selector_acc" in record
    drafter, _ = load_drafter_for_export(out)
    assert drafter.config.selector_top_k == 16 and drafter.config.conv_kernel_size == 2
    conv = drafter.layers[0].attention_conv
    assert conv.kernel_projection.weight.abs().sum() > 0, "the convolutions trained away from identity"
    assert read_export_config(f"{out}/export")["speculators_model_type"] == "dflash2"
    for export in (f"{out}/export", f"{out}/export-zlab"):  # the trainer's; `dflash-fast export --format zlab`'s
        if export.endswith("zlab"):
            assert main(["export", "--checkpoint", out, "--out", export, "--format", "zlab", "--dtype", "fp32"]) == 0
            assert read_export_config(export)["architectures"] == ["DFlash2DraftModel"]
        exported = load_exported(export)
        assert exported.config == drafter.config
        for name, p in drafter.named_parameters():
            assert torch.equal(dict(exported.named_parameters())[name], p), name


# ---------------------------------------------------------------- the quickstart


def test_the_dflash2_config_is_tiny_yaml_plus_the_dflash2_keys():
    import os

    import yaml

    from dflash_fast.evaluate.quickstart import REPO

    def read(name):
        with open(os.path.join(REPO, "configs", name)) as f:
            return yaml.safe_load(f)

    dflash, dflash2 = read("tiny.yaml"), read("tiny_dflash2.yaml")
    added = {"model": {"conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"},
             "loss": {"selector_alpha"}}
    for section, keys in added.items():
        assert set(dflash2[section]) - set(dflash[section]) == keys
        for key in keys:
            del dflash2[section][key]
    del dflash["output_dir"], dflash2["output_dir"]
    assert dflash2 == dflash


def test_quickstart_dflash2_trains_and_evaluates_the_checkpoint_greedy_exact(tmp_path):
    """The trainer exports speculators' dflash2 type; the eval stage drafts with the export, through the selector
    walk."""
    from test_quickstart import small_quickstart

    from dflash_fast.serve.export import read_export_config

    out = tmp_path / "qs"
    report = small_quickstart(out, drafter="dflash2")
    assert report["greedy_mismatches"] == 0 and report["tau"] >= 1.0 and report["block_size"] == 8
    assert read_export_config(str(out / "run" / "export"))["architectures"] == ["DFlash2DraftModel"]
