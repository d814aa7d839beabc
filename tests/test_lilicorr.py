"""LiLiCorr (docs/lilicorr.md): the lattice loss against ModelOpt's objective written from its equations as loops
(forward and every gradient, odd shapes), the walk, the candidates' log-probabilities out of the fused lm_head pass,
the drafter trained with every loss kind and weighting, and the config's refusals. The head against vLLM 0.32's own
`LiLiCorrHead` is tests/test_vllm_lilicorr.py (vLLM's venv)."""
import math

import pytest
import torch
from test_drafter import B, V, random_batch, random_drafter, small_config
from test_trainer import tiny  # noqa: F401 (the fixture: a tiny target and its store)

from dflash_fast.drafter.config import DrafterConfig
from dflash_fast.drafter.families import head_shapes
from dflash_fast.drafter.lilicorr import LatticeWeights, LiLiCorrDrafter, lattice_loss, walk

EPS = 1e-6
TOP_K = 4
LILICORR = dict(lilicorr_candidate_topk=TOP_K, lilicorr_hidden_size=16, lilicorr_num_heads=2,
                lilicorr_num_layers=2, lilicorr_mlp_ratio=1.5, lilicorr_factor_dim=8, lilicorr_logit_scale=6.0)
WEIGHTS = LatticeWeights(w_ce=0.3, w_margin=0.2, margin=1.5, w_pen=0.4)


def named(weights: LatticeWeights):
    """The forward's family weights (train config's loss.lilicorr_*, LossConfig.family_weights) of `weights`."""
    return {f"lilicorr_{field}": value for field, value in weights._asdict().items()}


def lilicorr_drafter(seed=0, **kw):
    """A LiLiCorr drafter whose head is far from its init (zero embeddings and biases would hide terms)."""
    d = random_drafter(seed, **{**LILICORR, **kw})
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in d.lilicorr.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return d


# ---------------------------------------------------------------- the loss, against the loops


def loop_lattice_loss(start, pair, ids, label, block_trained, teacher, weights):
    """ModelOpt's three terms (hf_lilicorr.py `_compute_lilicorr_loss`, `_distractor_penalty`) one block and one slot
    at a time, in Python scalars where it can: the node of slot s is the start logits (s = 0) or the pair logits out
    of the ground truth's candidate at s - 1; a slot is supervised while the ground truth was in every lattice slot
    up to it and every slot of its block trains."""
    n, s, k = ids.shape
    ce_sum = hinge_sum = pen_sum = start.new_zeros(())
    count = 0
    for b in range(n):
        if not bool(block_trained[b]):
            continue
        previous = None
        for j in range(s):
            row = ids[b, j].tolist()
            if int(label[b, j]) not in row:
                break
            g = row.index(int(label[b, j]))
            node = start[b] if j == 0 else pair[b, j - 1, previous]
            lse = torch.logsumexp(node, 0)
            ce_sum = ce_sum + (lse - node[g])
            if k > 1:
                best_other = max(node[i] for i in range(k) if i != g)
                hinge_sum = hinge_sum + torch.relu(weights.margin - (node[g] - best_other))
            for i in range(k):
                pen_sum = pen_sum + torch.exp(node[i] - lse) * max(float(teacher[b, j, g] - teacher[b, j, i]), 0.0)
            count += 1
            previous = g
    denom = max(count, 1)
    return (weights.w_ce * ce_sum + weights.w_margin * hinge_sum + weights.w_pen * pen_sum) / denom


@pytest.mark.parametrize("n, s, k", [(3, 1, 4), (5, 3, 2), (2, 5, 8), (4, 4, 1), (3, 6, 3), (7, 2, 16)])
def test_lattice_loss_and_its_gradients_equal_the_loops(n, s, k):
    gen = torch.Generator().manual_seed(n * 100 + s * 10 + k)
    start = (3 * torch.randn(n, k, generator=gen)).requires_grad_(True)
    pair = (3 * torch.randn(n, max(s - 1, 0), k, k, generator=gen)).requires_grad_(True)
    ids = torch.stack([torch.randperm(40, generator=gen)[:k] for _ in range(n * s)]).view(n, s, k)
    # the label: a candidate most of the time, sometimes missing (that ends the block's supervised prefix)
    pick = torch.randint(0, k, (n, s), generator=gen)
    label = ids.gather(-1, pick[..., None])[..., 0]
    label[torch.rand(n, s, generator=gen) < 0.15] = 99
    block_trained = torch.rand(n, generator=gen) > 0.2
    block_trained[0] = True
    teacher = 2 * torch.randn(n, s, k, generator=gen)
    got = lattice_loss(start, pair, ids, label, block_trained, teacher, WEIGHTS)
    grads = torch.autograd.grad(got.loss, (start, pair), allow_unused=True)
    want = loop_lattice_loss(start, pair, ids, label, block_trained, teacher, WEIGHTS)
    want_grads = torch.autograd.grad(want, (start, pair), allow_unused=True)
    torch.testing.assert_close(got.loss, want, rtol=1e-5, atol=1e-6)
    for g, w in zip(grads, want_grads):
        if w is None:
            assert g is None or not g.abs().sum()
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert got.loss.item() > 0 or k == 1  # one candidate: nothing to rank, every term 0


def test_each_term_of_the_lattice_loss_counts():
    """Dropping any one term (weight 0) changes the loss: none of the three is dead code."""
    gen = torch.Generator().manual_seed(0)
    n, s, k = 4, 3, 4
    start, pair = torch.randn(n, k, generator=gen), torch.randn(n, s - 1, k, k, generator=gen)
    ids = torch.arange(n * s * k).view(n, s, k)
    label, trained, teacher = ids[..., 1], torch.ones(n, dtype=torch.bool), torch.randn(n, s, k, generator=gen)
    full = lattice_loss(start, pair, ids, label, trained, teacher, WEIGHTS).loss
    for drop in ("w_ce", "w_margin", "w_pen"):
        assert lattice_loss(start, pair, ids, label, trained, teacher, WEIGHTS._replace(**{drop: 0.0})).loss != full


# ---------------------------------------------------------------- the walk


def test_walk_follows_the_previous_pick():
    gen = torch.Generator().manual_seed(2)
    table = torch.randn(5, 4, 4, generator=gen)
    picks, previous = [], 0
    for s in range(5):
        previous = max(range(4), key=lambda j: float(table[s, previous, j]))
        picks.append(previous)
    assert walk(table).tolist() == picks
    assert walk(table, lambda _slot, _row: 3).tolist() == [3] * 5


def block_inputs(d, hidden, anchor):
    """The loops' reading of LiLiCorr inference for one block (vLLM's spec_decode/lilicorr): ctx of the position
    before the anchor, the drafted slots' norm(x), each slot's top-K by raw log-softmax."""
    t = hidden.shape[0]
    ctx = d.context(hidden[None])
    anchors = torch.tensor([[t]])
    x = d.block_states(ctx, torch.arange(t)[None], torch.tensor([[anchor]]), anchors, anchors,
                       torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, t, dtype=torch.long))
    h = d.norm(x[0])[1:]
    log_probs = torch.log_softmax(h @ d.lm_head.T, -1)
    top = log_probs.topk(TOP_K, -1)
    return ctx[0, t - 1], h, top.indices, top.values


def test_propose_walks_the_lattice_and_the_training_forward_drafts_the_same():
    d = lilicorr_drafter().eval()
    batch = random_batch(t=24, anchors=((9,),), valid=((True,),))
    hidden, anchor = batch["hidden"][0, :9], int(batch["input_ids"][0, 9])
    with torch.no_grad():
        guess = d.propose(hidden, anchor)
        anchor_ctx, h, ids, log_probs = block_inputs(d, hidden, anchor)
        start, pair = d.lilicorr.scores(d.embed_tokens[ids][None], log_probs[None], h[None], anchor_ctx[None],
                                        torch.ones(1, dtype=torch.bool))
    start, pair = d.lilicorr.logit_scale * start[0], d.lilicorr.logit_scale * pair[0]
    picks = [int(start.argmax())]
    for s in range(1, B - 1):
        picks.append(int(pair[s - 1, picks[-1]].argmax()))
    assert guess.tolist() == [int(ids[s, c]) for s, c in enumerate(picks)]
    assert guess.tolist() != ids[:, 0].tolist() or picks != [0] * (B - 1), "the walk never left the top-1"
    # the training forward reads the same anchor (ctx at anchor - 1) and candidates: its drafts are the walk's
    out = d(batch, "kl")
    assert out.draft_argmax[0, 0, 1:].tolist() == guess.tolist()


def test_a_sampled_walk_hands_the_draw_the_walk_row_at_the_candidates():
    """T > 0 as vLLM drafts it: each slot's q is softmax(row / T) of the walk row out of the candidate drawn
    before it, the scores at the K candidates' ids and -inf elsewhere (vLLM's `_cache_draft_logits_kernel`)."""
    d = lilicorr_drafter().eval()
    batch = random_batch(t=24, anchors=((9,),), valid=((True,),))
    hidden, anchor = batch["hidden"][0, :9], int(batch["input_ids"][0, 9])
    seen, gen = [], torch.Generator().manual_seed(5)

    def draw(logits):
        seen.append(logits[0].clone())
        finite = torch.isfinite(logits[0]).nonzero()[:, 0]
        return finite[torch.randint(0, len(finite), (1,), generator=gen)]

    with torch.no_grad():
        guess = d.propose(hidden, anchor, draw=draw)
        anchor_ctx, h, ids, log_probs = block_inputs(d, hidden, anchor)
        table = d.lilicorr.walk_scores(d.embed_tokens[ids][None], log_probs[None], h[None], anchor_ctx[None],
                                       torch.ones(1, dtype=torch.bool))[0]
    previous = 0
    for s, row in enumerate(seen):
        assert set(torch.isfinite(row).nonzero()[:, 0].tolist()) == set(ids[s].tolist())
        torch.testing.assert_close(row[ids[s]], table[s, previous])
        previous = ids[s].tolist().index(int(guess[s]))


def test_the_evaluators_q_at_t_is_the_walk_rows_softmax_over_the_candidates():
    """Our evaluator's DraftSampler at T > 0 (as vLLM's rejection sampler reads its cached draft logits): q of each
    drafted slot is softmax(row / T) over the K candidates, the row out of the candidate drawn before it, 0 elsewhere;
    the chain leaves the greedy walk (not vacuous)."""
    from test_sampling_dflash2 import sampled_off_greedy

    d = lilicorr_drafter().eval()
    batch = random_batch(t=24, anchors=((9,),), valid=((True,),))
    hidden, anchor = batch["hidden"][0, :9], int(batch["input_ids"][0, 9])
    temperature = 3.0
    with torch.no_grad():
        _, drafts, q = sampled_off_greedy(d, hidden, anchor, temperature)
        anchor_ctx, h, ids, log_probs = block_inputs(d, hidden, anchor)
        table = d.lilicorr.walk_scores(d.embed_tokens[ids][None], log_probs[None], h[None], anchor_ctx[None],
                                       torch.ones(1, dtype=torch.bool))[0]
    expected, previous = torch.zeros_like(q), 0
    for s in range(B - 1):
        expected[s, ids[s]] = torch.softmax(table[s, previous] / temperature, -1)
        previous = ids[s].tolist().index(int(drafts[s]))
    torch.testing.assert_close(q, expected, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- training


ANCHORS = (2, 7, 13, 19)


def agreeing_batch(d, seed=0):
    """A batch whose teacher (every kind's label: the dense teacher's argmax, the stored argmax, the data token)
    picks one of the drafter's own top-K candidates at every drafted slot, candidate 0 or 1 by slot: the lattice
    terms then see supervised slots (a random teacher's label is rarely among 4 of 96 candidates)."""
    batch = random_batch(seed, t=24, anchors=(ANCHORS,), valid=((True,) * len(ANCHORS),))
    with torch.no_grad():
        top = (d.norm(d.batch_states(batch))[0] @ d.lm_head.T).topk(TOP_K, -1).indices.view(len(ANCHORS), B, TOP_K)
        for a, anchor in enumerate(ANCHORS):
            for j in range(1, B):
                label = int(top[a, j, j % 2])
                batch["last"][0, anchor + j - 1] = 30 * d.lm_head[label] / d.target_norm
                batch["teacher_topk_ids"][0, anchor + j - 1, 0] = label
                batch["input_ids"][0, anchor + j] = label
    return batch


@pytest.mark.parametrize("kind, weighting", [("kl", "decay"), ("kl", "dpace"), ("tv", "decay"), ("ce", "decay"),
                                             ("ce_data", "dpace"), ("kl_topk", "decay"), ("lk", "dpace")])
def test_lilicorr_trains_with_every_loss_kind_and_weighting(kind, weighting):
    """loss = the backbone's loss of the kind + the lattice terms; every head parameter gets a gradient (the
    penalty only where the kind reads the teacher's logits: w_pen 0 otherwise)."""
    d = lilicorr_drafter()
    batch = agreeing_batch(d)
    dense = kind not in ("ce", "ce_data", "kl_topk")
    weights = WEIGHTS if dense else WEIGHTS._replace(w_pen=0.0)
    out = d(batch, kind, weighting=weighting, **named(weights))
    plain = d(batch, kind, weighting=weighting, **named(LatticeWeights(0.0, 0.0, 2.0, 0.0)))
    assert out.lattice_loss is not None and out.lattice_loss.item() > 0 and math.isfinite(out.loss.item())
    torch.testing.assert_close(out.loss, plain.loss + out.lattice_loss)
    out.loss.backward()
    dead = [name for name, p in d.lilicorr.named_parameters() if p.grad is None or not p.grad.abs().sum()]
    assert dead == []
    assert d.fc.weight.grad.abs().sum() > 0


def test_the_penalty_needs_the_teachers_logits():
    d = lilicorr_drafter()
    batch = random_batch(t=24, anchors=((2, 7, 13, 19),), valid=((True, True, True, True),))
    with pytest.raises(ValueError, match="w_pen"):
        d(batch, "ce", **named(WEIGHTS))


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize("change, field", [
    (dict(lilicorr_candidate_topk=3), "lilicorr_candidate_topk"),
    (dict(lilicorr_candidate_topk=32), "lilicorr_candidate_topk"),
    (dict(lilicorr_num_heads=3), "lilicorr_num_heads"),
    (dict(lilicorr_vector_eps=0.7), "lilicorr_vector_eps"),
    (dict(lilicorr_logit_scale=0.0), "lilicorr_logit_scale"),
    (dict(lilicorr_num_layers=0), "lilicorr_num_layers"),
    (dict(sample_from_anchor=True), "sample_from_anchor"),
    (dict(selector_rank=8), "choose one family"),
])
def test_the_lilicorr_config_is_checked(change, field):
    with pytest.raises(ValueError, match=field):
        small_config(**{**LILICORR, **change})


def test_lilicorr_shapes_are_the_parameters():
    d = lilicorr_drafter()
    assert isinstance(d, LiLiCorrDrafter) and d.config.family == "lilicorr"
    assert head_shapes(d.config) == {f"lilicorr.{n}": tuple(p.shape) for n, p in d.lilicorr.named_parameters()}
    assert head_shapes(DrafterConfig(**{**d.config.to_dict(), "lilicorr_candidate_topk": 0})) == {}
    assert V > TOP_K


def test_lilicorr_with_dflash2s_convolutions_is_one_family_with_both():
    """LiLiCorr on the DFlash2 backbone (conv_kernel_size > 0): DFlashDrafter(cfg) builds LiLiCorrDrafter, the
    convolutions start as the identity (DFlash2Drafter's reset: base tap 1), and trainable_shapes
    (families.head_shapes) counts the convolutions' and the lattice's parameters, every one."""
    from dflash_fast.drafter.conv import DynamicConv
    from dflash_fast.drafter.model import DFlashDrafter
    from dflash_fast.drafter.weights import trainable_shapes

    torch.manual_seed(0)
    d = DFlashDrafter(small_config(**LILICORR, conv_kernel_size=2, conv_group_size=8))
    assert isinstance(d, LiLiCorrDrafter) and d.config.family == "lilicorr"
    convs = [m for m in d.modules() if isinstance(m, DynamicConv)]
    assert convs and all(torch.equal(m.base_kernel[:, 0], torch.ones_like(m.base_kernel[:, 0])) for m in convs)
    assert trainable_shapes(d.config) == {n: tuple(p.shape) for n, p in d.named_parameters()}


# ---------------------------------------------------------------- the export (vLLM's LiLiCorrDraftModel)


CONV = dict(conv_kernel_size=2, conv_group_size=8)


def export_lilicorr(tmp_path, **kw):
    """A LiLiCorr drafter and its zlab export (fp32, through the gate), and the export's config.json."""
    import json

    from dflash_fast.serve.export import export_drafter

    drafter = lilicorr_drafter(**kw)
    out = export_drafter(drafter, str(tmp_path / "export"), "target", torch.float32, fmt="zlab")
    with open(f"{out}/config.json") as f:
        return drafter, out, json.load(f)


@pytest.mark.parametrize("conv", [{}, CONV], ids=["dflash", "dflash2-convolutions"])
def test_a_lilicorr_export_is_vllms_lilicorr_draft_model_and_loads_back_walking_as_trained(tmp_path, conv):
    """The zlab layout as architectures ["LiLiCorrDraftModel"] with every field vLLM's LiLiCorr reads in dflash_config
    (and the convolutions' two with them), read by vLLM alone; the drafter rebuilt from it drafts what the trained one
    drafts (the lattice walk) and has its tensors."""
    from dflash_fast.serve.architecture import architecture
    from dflash_fast.serve.engines import served_architectures
    from dflash_fast.serve.export import load_exported

    drafter, out, config = export_lilicorr(tmp_path, **conv)
    cfg = drafter.config
    assert config["architectures"] == ["LiLiCorrDraftModel"] and config["has_own_lm_head"] is False
    want = {"lilicorr_enabled": True, **{k: getattr(cfg, k) for k in LILICORR}, "lilicorr_vector_eps": EPS,
            **conv}
    assert {k: v for k, v in config["dflash_config"].items() if k.startswith(("lilicorr_", "conv_"))} == want
    assert served_architectures(config) == {"vllm": architecture(cfg)}
    back = load_exported(out)
    assert isinstance(back, LiLiCorrDrafter) and architecture(back.config) == architecture(cfg)
    mine, theirs = dict(drafter.named_parameters()), dict(back.named_parameters())
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    for d in (drafter, back):
        d.set_frozen(embed_tokens=torch.randn(V, cfg.hidden_size, generator=torch.Generator().manual_seed(3)),
                     lm_head=torch.randn(V, cfg.hidden_size, generator=torch.Generator().manual_seed(4)),
                     target_norm=torch.ones(cfg.hidden_size))
    hidden = torch.randn(9, cfg.num_tapped, cfg.target_hidden_size, generator=torch.Generator().manual_seed(5))
    assert torch.equal(back.propose(hidden, 7), drafter.propose(hidden, 7))


def test_the_gate_compares_the_lattice_walk_the_logits_do_not_see(tmp_path):
    """A lattice tensor read back other than trained leaves every logit as it was: the gate refuses the export on the
    LiLiCorr scores (naming the tensor), and passes the same files against the weights written."""
    from dflash_fast.serve.export import gate, trainable_state_dict
    from dflash_fast.serve.layouts import ExportError

    drafter, out, _ = export_lilicorr(tmp_path, **CONV)
    written = trainable_state_dict(drafter)
    gate(out, drafter.config, written)
    trained = dict(written, **{"lilicorr.out_head.weight": written["lilicorr.out_head.weight"] + 0.5})
    with pytest.raises(ExportError, match=r"LiLiCorr (start|pair) scores.*lilicorr\.out_head\.weight"):
        gate(out, drafter.config, trained)


def test_the_speculators_format_refuses_a_lilicorr_drafter_naming_the_zlab_format():
    """speculators has no LiLiCorr model and vLLM's speculators adapter no lilicorr type: refused before anything is
    written, naming the field and the format that serves it; servable_format picks zlab."""
    from dflash_fast.serve.engines import check_servable, servable_format
    from dflash_fast.serve.layouts import ExportError

    cfg = lilicorr_drafter().config
    with pytest.raises(ExportError, match="lilicorr_candidate_topk=4.*--format zlab"):
        check_servable(cfg, "speculators")
    assert servable_format(cfg) == "zlab"


def test_the_lilicorr_card_gives_vllms_command_alone_and_no_sglang_one():
    """SGLang's LiLiCorr is an open pull request whose revisions disagree on our lattice tensor names
    (docs/lilicorr.md, "SGLang"): the zlab layout of a LiLiCorr drafter is read by vLLM alone, and its card gives
    vLLM's command and says that only vLLM serves it, with no SGLang command (a plain DFlash zlab export's card has
    one)."""
    from dflash_fast.serve.engines import serving_engines
    from dflash_fast.serve.model_card import serving

    assert serving_engines("zlab", "lilicorr") == ("vllm",)
    text = serving("runs/exp/export", "Qwen/Qwen3-8B", "zlab", 16, "lilicorr")
    assert "vllm serve Qwen/Qwen3-8B" in text and '"num_speculative_tokens": 15' in text
    assert "sglang" not in text.lower()
    assert "Only vLLM serves LiLiCorr (its LiLiCorrDraftModel, V2 model runner)" in text
    assert "sglang.launch_server" in serving("runs/exp/export", "Qwen/Qwen3-8B", "zlab", 16, "dflash")


# Edits of a LiLiCorr export's config.json that vLLM 0.32 refuses or would serve otherwise than trained, and the
# field the refusal must name.
REFUSED = {
    "disabled": ({"lilicorr_enabled": False}, "lilicorr_enabled=False"),
    "a field absent": ({"lilicorr_num_heads": None}, r"no \['lilicorr_num_heads'\]"),
    "K not a power of two": ({"lilicorr_candidate_topk": 3}, "lilicorr_candidate_topk=3"),
    "K zero": ({"lilicorr_candidate_topk": 0}, "lilicorr_candidate_topk=0"),
    "heads": ({"lilicorr_num_heads": 3}, "lilicorr_num_heads=3"),
    "taps without groups": ({"conv_kernel_size": 2}, "conv_kernel_size=2, conv_group_size=0"),
    "no slot to draft": ({"block_size": 1}, "block_size=1"),
}


@pytest.mark.parametrize("edit", list(REFUSED))
def test_an_export_vllms_lilicorr_would_refuse_or_serve_otherwise_is_refused_naming_the_field(tmp_path, edit):
    from dflash_fast.serve.engines import config_from_export
    from dflash_fast.serve.layouts import ExportError

    _, _, config = export_lilicorr(tmp_path)
    changes, field = REFUSED[edit]
    for key, value in changes.items():
        if value is None:
            del config["dflash_config"][key]
        else:
            config["dflash_config"][key] = value
    with pytest.raises(ExportError, match=field):
        config_from_export(config)


@pytest.mark.parametrize("top,match", [({"draft_vocab_size": V - 1}, f"draft_vocab_size={V - 1}"),
                                       ({"has_own_lm_head": True}, "has_own_lm_head=true")])
def test_a_draft_vocabulary_or_an_own_lm_head_is_refused_naming_the_field(tmp_path, top, match):
    """vLLM's LiLiCorr needs the target's whole vocabulary (no d2t map) and draws the candidates from the checkpoint's
    lm_head with has_own_lm_head: neither is the drafter trained here."""
    from dflash_fast.serve.engines import config_from_export
    from dflash_fast.serve.layouts import ExportError

    _, _, config = export_lilicorr(tmp_path)
    with pytest.raises(ExportError, match=match):
        config_from_export(dict(config, **top))


@pytest.mark.parametrize("architecture,conv", [("DFlashDraftModel", {}), ("DFlash2DraftModel", CONV)])
def test_the_lilicorr_export_served_as_plain_dflash_reads_as_another_drafter(tmp_path, architecture, conv):
    """The same files named as a plain DFlash drafter, or (with the convolutions and a selector's fields) a DFlash2
    one: every engine of that name serves the backbone alone, which the gate's comparison names
    (lilicorr_candidate_topk: trained 4, served 0), and the lattice tensors are no tensors of the drafter it reads."""
    from dflash_fast.serve.architecture import architecture as trained_architecture
    from dflash_fast.serve.engines import config_from_export, mismatches, served_architectures
    from dflash_fast.serve.export import read_weights
    from dflash_fast.serve.layouts import ExportError

    drafter, out, config = export_lilicorr(tmp_path, **conv)
    config["architectures"] = [architecture]
    if architecture == "DFlash2DraftModel":
        config["dflash_config"].update(selector_rank=4, selector_top_k=4)
    served = served_architectures(config)
    assert sorted(served) == ["sglang", "vllm"]
    lines = mismatches(trained_architecture(drafter.config), served)
    assert any(line.startswith("lilicorr_candidate_topk: trained 4, vllm serves 0") for line in lines), lines
    with pytest.raises(ExportError, match="unexpected.*lilicorr"):
        read_weights(out, config_from_export(config), warn=lambda _: None)


def test_the_trainer_trains_lilicorr_exports_it_and_its_checkpoint_builds_the_drafter_back(tiny, tmp_path):  # noqa: F811
    """Two steps of configs/tiny.yaml (its recipe, the penalty on) with LiLiCorr's keys on the tiny store: the run
    ends with its gated export in the zlab layout (vLLM's LiLiCorrDraftModel), and the checkpoint builds the LiLiCorr
    drafter back with every lattice tensor (finite), the export's. (Two steps of a fresh drafter rarely put the
    teacher's argmax among its top 4 of 384, so whether the lattice moves here is chance: the lattice's gradients
    are test_lilicorr_trains_with_every_loss_kind_and_weighting's.)"""
    import json

    from test_trainer import TINY_YAML, settings

    from dflash_fast.serve.export import load_exported
    from dflash_fast.train.checkpoint import load_drafter_for_export
    from dflash_fast.train.config import load_config
    from dflash_fast.train.trainer import train

    out = str(tmp_path / "run")
    keys = dict(model__lilicorr_candidate_topk=4, model__lilicorr_hidden_size=32, model__lilicorr_num_heads=2,
                model__lilicorr_factor_dim=8, schedule__steps=2)
    train(load_config(TINY_YAML, settings(tiny, out, export="true", **keys)))
    with open(f"{out}/export/config.json") as f:
        assert json.load(f)["architectures"] == ["LiLiCorrDraftModel"]
    exported = dict(load_exported(f"{out}/export").named_parameters())
    drafter, _ = load_drafter_for_export(out)
    assert drafter.config.lilicorr_candidate_topk == 4 and drafter.lilicorr is not None
    lattice = {f"lilicorr.{n}": p for n, p in drafter.lilicorr.named_parameters()}
    assert {n: tuple(p.shape) for n, p in lattice.items()} == head_shapes(drafter.config)
    assert all(torch.equal(p.to(exported[n].dtype), exported[n]) for n, p in lattice.items())
    assert all(torch.isfinite(p).all() for p in lattice.values())
