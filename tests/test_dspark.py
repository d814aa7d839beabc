"""DSpark (spec.md §8): slot alignment with sample_from_anchor, the Markov and confidence heads, and the loss,
against speculators 0.9.0's semantics written out as loops (tests/oracles.py: dspark_*)."""
import pytest
import torch
from oracles import dspark_batch_loss, position_weight, rms_norm
from test_drafter import B, V, proposal_fed_back, random_batch, random_drafter

from dflash_fast.drafter import eager, losses, ops
from dflash_fast.drafter.model import DrafterOutput, slot_metrics
from dflash_fast.drafter.targets import position_weights, slot_targets

EPS = 1e-6
HEAD_TYPES = ("vanilla", "gated", "rnn")


def dspark_drafter(head_type="vanilla", sample_from_anchor=True, confidence_with_markov=True, seed=0, **kw):
    d = random_drafter(
        seed,
        **kw,
        sample_from_anchor=sample_from_anchor,
        markov_rank=8,
        markov_head_type=head_type,
        confidence_head=True,
        confidence_head_with_markov=confidence_with_markov,
    )
    with torch.no_grad():  # weights large enough that the bias and the gates matter
        for p in list(d.markov_head.parameters()) + list(d.confidence_head.parameters()):
            p.normal_(0, 0.5)
    return d


def oracle_heads(d):
    m, c = d.markov_head, d.confidence_head
    heads = dict(type=m.head_type, w1=m.markov_w1.weight, w2=m.markov_w2.weight, conf_w=c.proj.weight,
                 conf_b=c.proj.bias, conf_with_markov=d.config.confidence_head_with_markov)
    if m.head_type == "gated":
        heads.update(gate_w=m.gate_proj.weight, gate_b=m.gate_proj.bias)
    if m.head_type == "rnn":
        heads.update(joint_w=m.joint_proj.weight, joint_b=m.joint_proj.bias)
    return heads


# One document, every block inside the row (speculators never draws an anchor in the last B positions).
ORACLE_BATCH = dict(anchors=((1, 6, 11, 14),), valid=((True, True, True, True),))


# Every head with the decay; the default head (configs/tiny_dspark.yaml: vanilla, kl, D-PACE) with D-PACE too.
ORACLE_CASES = [(head, "decay") for head in HEAD_TYPES] + [("vanilla", "dpace")]


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("sample_from_anchor", [True, False], ids=["from_anchor", "dflash_alignment"])
@pytest.mark.parametrize("head_type, weighting", ORACLE_CASES, ids=[f"{h}-{w}" for h, w in ORACLE_CASES])
def test_dspark_loss_heads_and_gradients_equal_speculators_semantics(head_type, weighting, sample_from_anchor, backend):
    """The Triton run folds the Markov bias into the fused lm_head loss (kernels/lm_head_loss.py, HAS_BIAS).
    D-PACE: the weights from exp(-CE) of the biased logits against the teacher argmax, the BCE on the decay."""
    d = dspark_drafter(head_type, sample_from_anchor)
    batch = random_batch(t=20, **ORACLE_BATCH)
    with ops.backend(f"lm_head_loss={backend}"):
        out = d(batch, "kl", gamma=3.0, confidence_alpha=0.7, weighting=weighting, dpace_alpha=0.3)
    out.loss.backward()
    got = {name: p.grad.clone() for name, p in d.named_parameters()}
    d.zero_grad()
    hidden = rms_norm(d.batch_states(batch), d.norm.weight, EPS)
    want, want_bce, slots = dspark_batch_loss(batch, hidden, oracle_heads(d), B, 3.0, sample_from_anchor,
                                              d.target_norm, d.lm_head, EPS, 0.7,
                                              dpace_alpha=0.3 if weighting == "dpace" else None)
    want.backward()
    torch.testing.assert_close(out.loss.double(), want.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.confidence_loss.double(), want_bce.detach(), rtol=1e-5, atol=1e-6)
    assert len(slots) == int(out.slot_mask.sum()) == (16 if sample_from_anchor else 12)
    for (r, i, j), (logits, acceptance, conf) in slots.items():
        assert out.draft_argmax[r, i, j] == logits.argmax(), "argmax of the Markov-biased logits"
        torch.testing.assert_close(out.alpha[r, i, j].double(), acceptance, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.confidence[r, i, j].double(), torch.sigmoid(conf).detach(), rtol=1e-5, atol=1e-6)
    for name, p in d.named_parameters():
        torch.testing.assert_close(got[name], p.grad.float(), rtol=1e-4, atol=1e-6, msg=name)


def test_confidence_head_without_markov_feature_reads_hidden_alone():
    d = dspark_drafter("vanilla", confidence_with_markov=False)
    assert d.confidence_head.proj.in_features == d.config.hidden_size
    batch = random_batch(t=20, **ORACLE_BATCH)
    out = d(batch, "kl")
    hidden = rms_norm(d.batch_states(batch), d.norm.weight, EPS)
    want, _, _ = dspark_batch_loss(batch, hidden, oracle_heads(d), B, 7.0, True, d.target_norm, d.lm_head, EPS, 1.0)
    torch.testing.assert_close(out.loss.double(), want.detach(), rtol=1e-5, atol=1e-6)


def test_confidence_bce_keeps_the_decay_under_dpace_weighting():
    """speculators: "D-PACE expects token CE, so keep the confidence BCE on fixed decay"."""
    d = dspark_drafter("gated")
    batch = random_batch(t=20, **ORACLE_BATCH)
    decay, dpace = d(batch, "kl", gamma=2.0), d(batch, "kl", gamma=2.0, weighting="dpace")
    assert not torch.allclose(decay.loss, dpace.loss)
    torch.testing.assert_close(dpace.confidence_loss, decay.confidence_loss)


def test_markov_bias_changes_the_drafter_logits_and_only_through_the_previous_token():
    """Vanilla: the bias of slot j depends on the token at its predicted position - 1, no other."""
    d = dspark_drafter("vanilla", sample_from_anchor=True)
    batch = random_batch(t=20, **ORACLE_BATCH)
    base = d(batch, "kl").alpha
    a = int(batch["anchors"][0, 1])
    changed = {k: v.clone() for k, v in batch.items()}
    changed["input_ids"][0, a + 2] = (changed["input_ids"][0, a + 2] + 1) % (V - 1)  # slot 2's previous token
    moved = d(changed, "kl").alpha
    assert not torch.allclose(moved[0, 1, 2], base[0, 1, 2])
    moved[0, 1, 2] = base[0, 1, 2]
    assert torch.equal(moved, base), "a previous token reached another slot"


# ---------------------------------------------------------------- slot alignment (spec.md §8 sample_from_anchor)


def test_sample_from_anchor_slot_j_predicts_p_plus_1_against_the_teacher_at_p():
    batch = random_batch(anchors=((2, 7),), valid=((True, True),), docs=[[0] * 9 + [1] * 15])
    batch["loss_mask"][0, 5] = False
    tg = slot_targets(batch, B, sample_from_anchor=True)
    assert tg.position[0, 0].tolist() == [3, 4, 5, 6] and tg.teacher_row[0, 0].tolist() == [2, 3, 4, 5]
    assert tg.prev_position[0, 0].tolist() == [2, 3, 4, 5]
    assert tg.slot_mask[0, 0].tolist() == [True, True, False, True]  # predicted p = 5 masked
    assert tg.slot_mask[0, 1].tolist() == [True, False, False, False]  # p = 9.. is the next document
    dflash = slot_targets(batch, B)
    assert dflash.prev_position[0, 0].tolist() == [2, 2, 3, 4], "slot 0 conditions on its own token"


def test_sample_from_anchor_weights_decay_from_slot_0():
    want = torch.tensor([position_weight(j, 2.5, True) for j in range(5)], dtype=torch.float32)
    torch.testing.assert_close(position_weights(5, 2.5, True), want, rtol=1e-6, atol=0)
    assert position_weights(5, 2.5, True)[0] == 1


def test_tau_offline_starts_at_slot_0_with_sample_from_anchor():
    mask = torch.tensor([[[True, True, True, True], [False, True, True, True]]])
    teacher = torch.zeros(1, 2, B, dtype=torch.long)
    draft = torch.tensor([[[0, 0, 1, 0], [9, 0, 0, 0]]])
    m = slot_metrics(DrafterOutput(torch.zeros(()), None, draft, teacher, mask, torch.zeros(1, 2, B), first_slot=0))
    assert m["blocks"] == 1 and m["tau_sum"] == 1 + 2, "block 1's slot 0 is masked: not a block"


# ---------------------------------------------------------------- inference: the Markov chain inside the block


@pytest.mark.parametrize("sample_from_anchor", [True, False], ids=["from_anchor", "dflash_alignment"])
@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_propose_drafts_each_slot_from_the_token_drafted_before_it(head_type, sample_from_anchor):
    """Feeding the drafted tokens back as the ground truth makes the training forward's argmaxes the proposal."""
    d = dspark_drafter(head_type, sample_from_anchor)
    with torch.no_grad():
        d.markov_head.markov_w2.weight.mul_(20)  # a bias that outweighs the base logits: the chain decides
    guess, out, batch = proposal_fed_back(d, sample_from_anchor)
    assert torch.equal(guess, out.draft_argmax[0, 0, d.config.first_slot :])


# ---------------------------------------------------------------- the loss op


def test_acceptance_rate_is_the_overlap_of_drafter_and_teacher():
    gen = torch.Generator().manual_seed(0)
    n, h, v, r = 7, 16, 29, 3
    x, last = torch.randn(n, h, generator=gen), torch.randn(n, h, generator=gen)
    w, e, w2 = torch.randn(v, h, generator=gen), torch.randn(n, r, generator=gen), torch.randn(v, r, generator=gen)
    out = eager.lm_head_loss(x, torch.ones(h), w, torch.ones(n), "kl", n, EPS,
                             losses.Teacher(last=last, final_norm_weight=torch.ones(h)), markov=losses.Markov(e, w2))
    q = torch.softmax(rms_norm(x, torch.ones(h), EPS) @ w.double().T + e.double() @ w2.double().T, -1)
    p = torch.softmax(rms_norm(last, torch.ones(h), EPS) @ w.double().T, -1)
    torch.testing.assert_close(out.alpha.double(), 1 - 0.5 * (q - p).abs().sum(-1), rtol=1e-5, atol=1e-6)


def test_a_confidence_head_without_the_full_teacher_is_refused():
    with pytest.raises(ValueError, match="full teacher"):
        dspark_drafter()(random_batch(t=20, **ORACLE_BATCH), "ce")


def test_dspark_config_is_checked():
    with pytest.raises(ValueError, match="markov_head_type"):
        random_drafter(markov_rank=4, markov_head_type="lstm")
    with pytest.raises(ValueError, match="confidence_head_with_markov"):
        random_drafter(confidence_head=True)
    assert ops.backend_of("lm_head_loss") == "eager"


def test_dspark_config_keys_are_checked_at_the_edge():
    from dflash_fast.train.config import ConfigError, load_config

    base = ["data.store=x"]
    dspark = ["model.markov_rank=16", "model.confidence_head=true", "model.sample_from_anchor=true"]
    cfg = load_config(None, base + dspark)
    assert cfg.model.drafter_options()["markov_rank"] == 16 and cfg.model.drafter_options()["sample_from_anchor"]
    for bad, what in (
        (["model.confidence_head=true"], "model.markov_rank > 0"),
        (["model.markov_rank=4", "model.markov_head_type=lstm"], "markov_head_type"),
        (["model.markov_rank=4", "model.confidence_head=true", "loss.kind=kl_topk"], "full teacher"),
    ):
        with pytest.raises(ConfigError, match=what):
            load_config(None, base + bad)


# ---------------------------------------------------------------- export: speculators' dspark type, vLLM's dspark


def written(out, cfg):
    import json

    from dflash_fast.serve.export import read_weights

    with open(f"{out}/config.json") as f:
        return json.load(f), read_weights(out, cfg)


@pytest.mark.parametrize("sample_from_anchor", [True, False], ids=["from_anchor", "dflash_alignment"])
def test_dspark_export_passes_the_gate_and_rebuilds_as_vllm_reads_it(tmp_path, sample_from_anchor):
    from dflash_fast.serve.export import export_drafter, load_exported

    d = dspark_drafter("vanilla", sample_from_anchor)
    out = export_drafter(d, str(tmp_path / "export"), "tiny-target", torch.float32)
    config, weights = written(out, d.config)
    assert config["speculators_model_type"] == "dspark" and config["architectures"] == ["DSparkDraftModel"]
    assert config["sample_from_anchor"] is sample_from_anchor and config["markov_rank"] == 8
    assert config["markov_head_type"] == "vanilla" and config["enable_confidence_head"] is True
    assert config["confidence_head_with_markov"] is True and config["aux_hidden_state_layer_ids"] == [1, 2, 3]
    tokens = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    assert tokens == (B if sample_from_anchor else B - 1)
    assert weights["markov_head.markov_w1.weight"].shape == weights["markov_head.markov_w2.weight"].shape == (V, 8)
    assert weights["confidence_head.proj.weight"].shape == (1, d.config.hidden_size + 8)
    assert weights["confidence_head.proj.bias"].shape == (1,)
    back = load_exported(out)
    back.set_frozen(d.embed_tokens, d.lm_head, d.target_norm)
    batch = random_batch(t=20, **ORACLE_BATCH)
    (want, want_conf), (got, got_conf) = d.block_logits(batch), back.block_logits(batch)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_conf, want_conf)
    assert torch.equal(back.propose(batch["hidden"][0, :9], 5), d.propose(batch["hidden"][0, :9], 5))


def test_the_gate_compares_the_markov_bias_and_the_confidence(tmp_path, monkeypatch):
    """A written Markov W2 or confidence weight that differs from the trained one fails the gate."""
    from dflash_fast.serve import export

    for name in ("markov_head.markov_w2.weight", "confidence_head.proj.weight"):
        real_save = __import__("safetensors.torch", fromlist=["save_file"]).save_file

        def save_bumped(tensors, path, metadata=None, name=name):
            real_save({k: v + 0.5 if k == name else v for k, v in tensors.items()}, path, metadata=metadata)

        monkeypatch.setattr("safetensors.torch.save_file", save_bumped)
        with pytest.raises(export.ExportError, match="other logits"):
            export.export_drafter(dspark_drafter(), str(tmp_path / "export"), "t", torch.float32)
        monkeypatch.undo()


@pytest.mark.parametrize("head_type", ["gated", "rnn"])
def test_a_markov_head_vllm_does_not_serve_is_never_exported(tmp_path, head_type):
    from dflash_fast.serve.export import export_drafter
    from dflash_fast.serve.layouts import ExportError

    with pytest.raises(ExportError, match="markov_head_type: trained '" + head_type):
        export_drafter(dspark_drafter(head_type), str(tmp_path / "export"), "t", torch.float32)
    with pytest.raises(ExportError, match="markov_rank"):
        export_drafter(dspark_drafter(), str(tmp_path / "z"), "t", torch.float32, fmt="zlab")


@pytest.mark.parametrize("kind, dpace", [("kl", None), ("tv", None), ("kl", losses.DPace(0.5, 5))])
def test_fused_markov_bias_equals_the_eager_twin_across_chunks(kind, dpace):
    """Odd shapes (N = 45 rows in 16- or 32-row chunks under the interpreter, V = 97, H = 24, r = 5), fp32:
    loss, alpha, argmaxes and the gradients of h, norm_weight, e and w2."""
    from dflash_fast.kernels.lm_head_loss import lm_head_loss as fused

    gen = torch.Generator().manual_seed(3)
    n, h, v, r, u = 45, 24, 97, 5, 19
    x, w = torch.randn(n, h, generator=gen), torch.randn(v, h, generator=gen)
    norm = 1 + 0.1 * torch.randn(h, generator=gen)
    e, w2 = torch.randn(n, r, generator=gen), torch.randn(v, r, generator=gen)
    weights = torch.rand(n, generator=gen)
    weights[::4] = 0
    teacher = losses.Teacher(last=torch.randn(u, h, generator=gen), final_norm_weight=torch.ones(h),
                            index=torch.randint(0, u, (n,), generator=gen))
    results = []
    for fn in (eager.lm_head_loss, fused):
        inputs = [t.clone().requires_grad_(True) for t in (x, norm, e, w2)]
        out = fn(inputs[0], inputs[1], w, weights, kind, 30, EPS, teacher, dpace, markov=losses.Markov(*inputs[2:]))
        out.loss.backward()
        results.append((out, [t.grad for t in inputs]))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.alpha, want.alpha, rtol=1e-5, atol=1e-6)
    assert torch.equal(got.draft_argmax, want.draft_argmax) and torch.equal(got.teacher_argmax, want.teacher_argmax)
    for name, g, wg in zip(("h", "norm_weight", "e", "w2"), got_grads, want_grads):
        torch.testing.assert_close(g, wg, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("trained", ["e,w2", "e", "w2"])
def test_fused_markov_gradients_come_from_one_read_of_dlogits_on_odd_shapes(dtype, trained):
    """de and dW2 come out of the dxd GEMM (HAS_MARKOV): r = 53 columns of W2 spread over the programs of a row tile
    (H = 150: three column tiles under the interpreter, two slices of 32, the last partial), dW2 summed over
    chunks by atomic adds; either input
    alone may train. fp32 and fp16 inputs against the eager twin on the same values in fp32 (max error relative
    to the largest entry, as tests/test_kernel_lm_head_loss.py)."""
    from dflash_fast.kernels.lm_head_loss import lm_head_loss as fused

    gen = torch.Generator().manual_seed(5)
    n, h, v, r, u = 45, 150, 203, 53, 23
    x, w = torch.randn(n, h, generator=gen), 0.3 * torch.randn(v, h, generator=gen)
    norm = 1 + 0.1 * torch.randn(h, generator=gen)
    e, w2 = torch.randn(n, r, generator=gen), 0.3 * torch.randn(v, r, generator=gen)
    weights = torch.rand(n, generator=gen)
    weights[::4] = 0
    last = torch.randn(u, h, generator=gen)
    index = torch.randint(0, u, (n,), generator=gen)
    train = {"e": "e" in trained.split(","), "w2": "w2" in trained.split(",")}
    results = []
    for fn, dt in ((eager.lm_head_loss, torch.float32), (fused, dtype)):
        inputs = [t.to(dtype).to(dt).requires_grad_(grad) for t, grad in
                  ((x, True), (norm, True), (e, train["e"]), (w2, train["w2"]))]
        teacher = losses.Teacher(last=last.to(dtype).to(dt), final_norm_weight=torch.ones(h, dtype=dt), index=index)
        out = fn(inputs[0], inputs[1], w.to(dtype).to(dt), weights, "kl", 30, EPS, teacher,
                 markov=losses.Markov(*inputs[2:]))
        out.loss.backward()
        results.append((out, [t.grad for t in inputs]))
    (want, want_grads), (got, got_grads) = results
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.loss, want.loss, rtol=tol, atol=tol)
    for name, g, wg in zip(("h", "norm_weight", "e", "w2"), got_grads, want_grads):
        assert (g is None) == (wg is None) == (name in train and not train[name]), name
        if g is not None:
            assert g.dtype == dtype, name
            err = (g.float() - wg).abs().max() / wg.abs().max()
            assert err <= (2e-5 if dtype == torch.float32 else 1e-2), (name, float(err))
