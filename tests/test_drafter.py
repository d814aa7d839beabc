"""The drafter, its anchored mask, targets at p-1 and metrics (spec.md §3-6); export is tests/test_export.py."""

import pytest
import torch
import torch.nn.functional as F
from oracles import position_weight, trained_slots, visible_keys
from tiny_targets import tiny_model, tiny_sizes

from dflash_fast.drafter import eager, masks, ops
from dflash_fast.drafter.config import DrafterConfig
from dflash_fast.drafter.model import DFlashDrafter, DrafterOutput, build_drafter, resolve_mask_token_id, slot_metrics
from dflash_fast.drafter.targets import position_weights

V, H, K, B = 96, 32, 3, 4


def small_config(**kw) -> DrafterConfig:
    args = dict(
        **tiny_sizes(H),
        vocab_size=V,
        layer_ids=[0, 1, 2],
        target_num_layers=4,
        target_hidden_size=H,
        mask_token_id=V - 1,
        num_layers=2,
        block_size=B,
    )
    args.update(kw)
    return DrafterConfig(**args)


def random_drafter(seed=0, **kw) -> DFlashDrafter:
    torch.manual_seed(seed)
    d = DFlashDrafter(small_config(**kw))
    d.reset_parameters(std=0.2)
    d.set_frozen(torch.randn(V, H), torch.randn(V, H), 1 + 0.1 * torch.randn(H))
    return d


def random_batch(seed=0, t=24, anchors=((2, 7, 15, 22),), valid=((True, True, True, False),), docs=None, topk=4):
    g = torch.Generator().manual_seed(seed)
    r = len(anchors)
    doc = torch.tensor(docs) if docs is not None else torch.zeros(r, t, dtype=torch.long)
    starts = masks.document_starts(doc)
    t_logits = torch.randn(r, t, V, generator=g)
    top = t_logits.topk(topk, -1)
    return dict(
        input_ids=torch.randint(0, V - 1, (r, t), generator=g),
        loss_mask=torch.ones(r, t, dtype=torch.bool),
        document_ids=doc,
        position_ids=torch.arange(t).expand(r, t) - starts,
        hidden=torch.randn(r, t, K, H, generator=g),
        last=torch.randn(r, t, H, generator=g),
        teacher_topk_ids=top.indices,
        teacher_topk_logits=top.values,
        teacher_lse=t_logits.logsumexp(-1),
        anchors=torch.tensor(anchors),
        anchor_valid=torch.tensor(valid),
    )


def proposal_fed_back(d, sample_from_anchor):
    """Draft one block from anchor 9 with `d.propose`, then feed the drafted tokens back as the ground truth:
    (the proposal, the training forward's output on that batch, the batch). For a drafter whose drafts depend on
    the token drafted before them (DSpark's chain, DFlash2's selector), the forward's drafts must be the proposal."""
    batch = random_batch(t=24, anchors=((9,),), valid=((True,),))
    guess = d.propose(batch["hidden"][0, :9], int(batch["input_ids"][0, 9]))
    assert guess.shape == (B if sample_from_anchor else B - 1,)
    batch["input_ids"][0, 10 : 10 + len(guess)] = guess
    return guess, d(batch, "kl"), batch


# ---------------------------------------------------------------- the anchored mask (spec.md §4)


def row_mask(anchors, doc, window=None, causal=False, valid=None):
    a = torch.tensor([anchors])
    v = torch.ones_like(a, dtype=torch.bool) if valid is None else torch.tensor([valid])
    return eager.anchored_attention_mask(a, v, torch.tensor([doc]), B, window, causal)[0]


def test_context_is_strictly_before_anchor():
    m = row_mask([5], [0] * 12)
    for j in range(B):
        assert m[j, :5].all(), "positions before the anchor must be visible"
        assert not m[j, 5:12].any(), "the anchor's own position and later ones must be invisible (< not <=)"


def test_context_stays_inside_the_anchor_document():
    m = row_mask([2, 9], [0] * 6 + [1] * 6)
    assert m[0:B, 0:2].all() and not m[0:B, 2:12].any()
    assert not m[B : 2 * B, 0:6].any(), "the previous document is invisible"
    assert m[B : 2 * B, 6:9].all() and not m[B : 2 * B, 9:12].any()


def test_window_edge_is_anchor_minus_window():
    m = row_mask([8], [0] * 12, window=3)
    assert m[:, 5:8].all(), "p >= a - W is visible"
    assert not m[:, :5].any(), "p < a - W is invisible"


def test_other_blocks_are_invisible_and_own_block_is_bidirectional():
    m = row_mask([3, 6], [0] * 10)
    t = 10
    assert m[0:B, t : t + B].all(), "a block sees all of its own slots"
    assert not m[0:B, t + B : t + 2 * B].any() and not m[B : 2 * B, t : t + B].any()


def test_causal_in_block_sees_only_earlier_slots():
    m = row_mask([3], [0] * 10, causal=True)
    blk = m[:, 10 : 10 + B]
    assert torch.equal(blk, torch.tril(torch.ones(B, B, dtype=torch.bool)))


def test_causal_in_block_and_the_window_apply_per_layer(monkeypatch):
    """Published z-lab drafters mix causal sliding layers with bidirectional full layers."""
    seen = []
    real = ops.anchored_attention

    def record(*args, **kwargs):
        seen.append((kwargs["window"], kwargs["causal_in_block"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "anchored_attention", record)
    d = random_drafter(num_layers=3, layer_types=["sliding", "full", "sliding"], sliding_window=5,
                       causal_in_block=[True, False, False])
    d(random_batch(), "kl")
    assert seen == [(5, True), (None, False), (5, False)]
    assert small_config(causal_in_block=True).causal_in_block == [True, True], "one flag means every layer"
    with pytest.raises(ValueError, match="one true/false per drafter layer"):
        small_config(causal_in_block=[True])


def test_the_window_rule_reaches_every_layer_in_training_and_drafting(monkeypatch):
    """model.window_from: the training forward and the evaluator's propose both attend with the drafter's rule;
    a config without the key (an old checkpoint) has spec.md §4's."""
    seen = []
    real = ops.anchored_attention

    def record(*args, **kwargs):
        seen.append(kwargs["window_from"])
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "anchored_attention", record)
    assert small_config(layer_types=["sliding", "full"], sliding_window=5).window_from == "anchor"
    d = random_drafter(layer_types=["sliding", "full"], sliding_window=5, window_from="query")
    d(random_batch(), "kl")
    d.propose(torch.randn(9, 3, H), 4)
    assert seen == ["query"] * 4
    with pytest.raises(ValueError, match="window 3 < block_size 4"):
        small_config(layer_types=["sliding", "full"], sliding_window=3, window_from="query")


def test_invalid_anchor_sees_nothing():
    m = row_mask([3, 6], [0] * 10, valid=[True, False])
    assert not m[B:].any() and m[:B].any()


# ---------------------------------------------------------------- inputs and targets (spec.md §3, §5)


def test_every_tapped_layer_reaches_fc():
    d = random_drafter()
    hidden = torch.randn(1, 10, K, H)
    base = d.context(hidden)
    for k in range(K):
        bumped = hidden.clone()
        bumped[:, :, k] += 1.0
        assert not torch.allclose(d.context(bumped), base), f"tapped layer {k} does not reach fc"


def test_slot_j_is_scored_against_teacher_at_p_minus_1():
    d = random_drafter()
    batch = random_batch()
    t = batch["input_ids"].shape[1]
    batch["teacher_topk_ids"][:, :, 0] = torch.arange(t) % (V - 1)  # stored argmax at row position = the position
    out = d(batch, "ce")
    a = batch["anchors"][0]
    for i in range(3):
        for j in range(1, B):
            if out.slot_mask[0, i, j]:
                assert out.teacher_argmax[0, i, j] == (a[i] + j - 1) % (V - 1)


def test_slot_zero_never_contributes():
    d = random_drafter()
    batch = random_batch()
    base = d(batch, "kl").loss
    for i, a in enumerate(batch["anchors"][0].tolist()[:3]):
        changed = {k: v.clone() for k, v in batch.items()}
        changed["last"][0, a - 1] += 5.0  # the teacher slot 0 would use
        assert torch.allclose(d(changed, "kl").loss, base), "slot 0 contributed to the loss"
        changed["last"][0, a] += 5.0  # the teacher of slot 1
        assert not torch.allclose(d(changed, "kl").loss, base)
    out = d(batch, "kl")
    assert not out.slot_mask[..., 0].any()


def test_slots_leaving_the_document_or_masked_are_not_trained():
    d = random_drafter()
    batch = random_batch(anchors=((2, 7),), valid=((True, True),), docs=[[0] * 9 + [1] * 15])
    batch["loss_mask"][0, 4] = False
    out = d(batch, "kl")
    assert out.slot_mask[0, 0].tolist() == [False, True, False, True]  # p=4 masked
    assert out.slot_mask[0, 1].tolist() == [False, True, False, False]  # p=9, 10 are the next document


def ce_against_stored_argmax(d: DFlashDrafter, batch):
    """Per-slot CE [A*B] of the drafter's materialised logits against the stored teacher argmax at p - 1,
    and the slot mask [R, A, B]: a reference for the `ce` loss outside ops.lm_head_loss (one row)."""
    from dflash_fast.drafter.targets import gather_rows, slot_targets

    tg = slot_targets(batch, d.config.block_size)
    x = d.batch_states(batch)
    logq = F.log_softmax(F.linear(d.norm(x[0]), d.lm_head).float(), -1)
    labels = gather_rows(batch["teacher_topk_ids"], tg.teacher_row)[:, 0]
    return -logq.gather(1, labels[:, None])[:, 0], tg.slot_mask


def test_loss_weights_and_denominator():
    w = position_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1 and torch.isclose(w[8], torch.exp(torch.tensor(-1.0)))
    d = random_drafter()
    batch = random_batch()
    out = d(batch, "ce")
    x = d.batch_states(batch)
    logq = F.log_softmax(F.linear(d.norm(x[0]), d.lm_head).float(), -1)
    slots = list(trained_slots(batch, B))  # spec.md §5 by hand (tests/oracles.py), not the drafter's slot_targets
    assert len(slots) == 9
    expected = sum(position_weight(j, 7.0) * -logq[i * B + j, batch["teacher_topk_ids"][0, p - 1, 0]]
                   for _, i, j, p in slots) / len(slots)
    assert torch.allclose(out.loss, expected.float(), atol=1e-5)


def capture_norm_input(model):
    """The final norm's input, by a hook that returns None (a returned value would replace the output)."""
    captured = {}

    def hook(_module, args, _output):
        captured["last"] = args[0].detach().clone()

    model.model.norm.register_forward_hook(hook)
    return captured


def saved_tiny_model(directory, arch="qwen3", tie_word_embeddings=False):
    """A tiny 4-layer target of `arch` with the drafter's H and V (norm weights randomised), saved to `directory`."""
    model = tiny_model(arch, num_layers=4, hidden_size=H, vocab_size=V, tie_word_embeddings=tie_word_embeddings).eval()
    model.save_pretrained(directory)
    return model


def test_teacher_logits_from_last_equal_target_logits_without_double_norm(tmp_path):
    model = saved_tiny_model(tmp_path)
    d = build_drafter(str(tmp_path), [0, 1, 2], mask_token_id=V - 1, num_layers=1, block_size=B)
    captured = capture_norm_input(model)
    ids = torch.randint(0, V, (1, 12))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    eps = model.config.rms_norm_eps
    teacher = F.linear(eager.rms_norm(captured["last"], d.target_norm, eps), d.lm_head)
    assert torch.allclose(teacher, out.logits, atol=1e-5)
    twice = F.linear(eager.rms_norm(out.hidden_states[-1], d.target_norm, eps), d.lm_head)
    assert not torch.allclose(twice, out.logits, atol=1e-3), "HF's last hidden state is already normed"


def test_frozen_tensors_load_in_the_compute_dtype_and_the_rest_stays_fp32(tmp_path):
    model = saved_tiny_model(tmp_path, tie_word_embeddings=True)
    d = build_drafter(
        str(tmp_path), [0, 1, 2], mask_token_id=V - 1, frozen_dtype=torch.bfloat16, num_layers=1, block_size=B
    )
    embed = model.model.embed_tokens.weight.detach()
    assert d.embed_tokens.dtype == d.lm_head.dtype == torch.bfloat16
    assert torch.equal(d.embed_tokens, embed.bfloat16()) and torch.equal(d.lm_head, embed.bfloat16())  # tied
    assert d.target_norm.dtype == torch.float32 and torch.equal(d.target_norm, model.model.norm.weight.detach())
    assert all(p.dtype == torch.float32 for p in d.parameters())


def test_zero_centred_final_norm_is_loaded_as_one_plus_w(tmp_path):
    model = saved_tiny_model(tmp_path, "qwen3_next")
    d = build_drafter(str(tmp_path), [0, 1, 2], mask_token_id=V - 1, num_layers=1, block_size=B)
    captured = capture_norm_input(model)
    with torch.no_grad():
        out = model(torch.randint(0, V, (1, 10)))
    teacher = F.linear(eager.rms_norm(captured["last"], d.target_norm, model.config.rms_norm_eps), d.lm_head)
    assert torch.allclose(teacher, out.logits, atol=1e-4)


def test_only_trainable_parameters_receive_gradients():
    d = random_drafter()
    d(random_batch(), "kl").loss.backward()
    names = {n for n, _ in d.named_parameters()}
    assert not names & {"embed_tokens", "lm_head", "target_norm"}, "frozen target tensors must not be parameters"
    for name in ("embed_tokens", "lm_head", "target_norm"):
        assert getattr(d, name).grad is None
    missing = [n for n, p in d.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, f"trainable parameters without gradient: {missing}"


def test_mask_token_resolution():
    class Tok:
        mask_token_id = None

        def __len__(self):
            return 90

    assert resolve_mask_token_id(96, 5) == 5
    assert resolve_mask_token_id(96, None, Tok()) == 95
    Tok.__len__ = lambda _self: 96
    with pytest.raises(ValueError, match="model.mask_token_id"):
        resolve_mask_token_id(96, None, Tok())
    with pytest.raises(ValueError, match="outside"):
        resolve_mask_token_id(96, 96)


def test_a_full_vocabulary_without_a_mask_token_embeds_pad_else_eos_else_unk_as_speculators_does():
    """SmolLM2's case: no mask token and no spare embedding row. The order is speculators'
    (train/utils.py resolve_mask_token_id); an explicit id or the tokenizer's own mask token still wins."""
    class Tok:
        mask_token_id, pad_token_id, eos_token_id, unk_token_id = None, 2, 7, 0

        def __len__(self):
            return 96

    assert resolve_mask_token_id(96, None, Tok()) == 2
    Tok.pad_token_id = None
    assert resolve_mask_token_id(96, None, Tok()) == 7
    Tok.eos_token_id = None
    assert resolve_mask_token_id(96, None, Tok()) == 0
    assert resolve_mask_token_id(96, 5, Tok()) == 5
    Tok.mask_token_id = 9
    assert resolve_mask_token_id(96, None, Tok()) == 9
    Tok.mask_token_id = Tok.unk_token_id = None
    with pytest.raises(ValueError, match="model.mask_token_id"):
        resolve_mask_token_id(96, None, Tok())


# ---------------------------------------------------------------- a second, naive implementation


def naive_block_logits(d: DFlashDrafter, batch, i):
    """One block by hand: slice its visible context, run every layer with plain softmax attention."""
    cfg = d.config
    a = int(batch["anchors"][0, i])
    doc = batch["document_ids"][0]
    start = int((doc == doc[a]).nonzero()[0])
    ctx = F.linear(batch["hidden"][0, start:a].reshape(a - start, -1), d.fc.weight)
    ctx = eager.rms_norm(ctx, d.hidden_norm.weight, cfg.rms_norm_eps)
    pos0 = int(batch["position_ids"][0, a])
    ids = torch.tensor([int(batch["input_ids"][0, a])] + [cfg.mask_token_id] * (cfg.block_size - 1))
    x = d.embed_tokens[ids]
    ctx_pos = batch["position_ids"][0, start:a]
    blk_pos = torch.arange(pos0, pos0 + cfg.block_size)
    for layer in d.layers:
        att = layer.self_attn
        hx = layer.input_layernorm(x)
        heads = []
        for h in range(cfg.num_attention_heads):
            kv = h // (cfg.num_attention_heads // cfg.num_key_value_heads)
            sl = slice(kv * cfg.head_dim, (kv + 1) * cfg.head_dim)
            q = d.rope.rotate(
                att.q_norm(att.q_proj(hx)[:, h * cfg.head_dim : (h + 1) * cfg.head_dim])[:, None],
                *d.rope.cos_sin(blk_pos, x.dtype),
            )[:, 0]
            keys, values = [], []
            for src, pos in ((ctx, ctx_pos), (hx, blk_pos)):
                if len(src):
                    keys.append(
                        d.rope.rotate(att.k_norm(att.k_proj(src)[:, sl])[:, None], *d.rope.cos_sin(pos, x.dtype))[:, 0]
                    )
                    values.append(att.v_proj(src)[:, sl])
            k, v = torch.cat(keys), torch.cat(values)
            heads.append(torch.softmax(q @ k.T / cfg.head_dim**0.5, -1) @ v)
        x = x + att.o_proj(torch.cat(heads, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return F.linear(d.norm(x), d.lm_head)


def test_drafter_equals_naive_per_block_implementation():
    d = random_drafter()
    batch = random_batch(anchors=((1, 6, 13, 17),), valid=((True, True, True, True),), docs=[[0] * 10 + [1] * 14])
    out = d(batch, "kl")
    loss, count = 0.0, 0
    w = position_weights(B, 7.0)
    for i in range(4):
        logits = naive_block_logits(d, batch, i)
        assert torch.equal(logits.argmax(-1)[1:], out.draft_argmax[0, i, 1:])
        a = int(batch["anchors"][0, i])
        for j in range(1, B):
            if out.slot_mask[0, i, j]:
                teacher = F.linear(eager.rms_norm(batch["last"][0, a + j - 1], d.target_norm, 1e-6), d.lm_head)
                loss = loss - w[j] * (torch.softmax(teacher, -1) * torch.log_softmax(logits[j], -1)).sum()
                count += 1
    assert torch.allclose(out.loss, loss / count, atol=1e-5)


def test_propose_equals_training_forward_at_the_same_anchor():
    d = random_drafter()
    batch = random_batch(anchors=((9,),), valid=((True,),))
    out = d(batch, "kl")
    guess = d.propose(batch["hidden"][0, :9], int(batch["input_ids"][0, 9]))
    assert torch.equal(guess, out.draft_argmax[0, 0, 1:])


# ---------------------------------------------------------------- metrics (spec.md §6)


def test_tau_offline_counts_leading_matches_only():
    mask = torch.tensor([[[False, True, True, True], [False, True, True, True], [False, False, False, False]]])
    teacher = torch.zeros(1, 3, B, dtype=torch.long)
    draft = torch.tensor([[[9, 0, 1, 0], [9, 0, 0, 0], [0, 0, 0, 0]]])  # block 0: match, miss, match -> 1 leading
    alpha = torch.arange(3 * B, dtype=torch.float32).view(1, 3, B) / 16
    m = slot_metrics(DrafterOutput(torch.zeros(()), None, draft, teacher, mask, alpha))
    assert m["blocks"] == 2 and m["tau_sum"] == (1 + 1) + (1 + 3)
    assert m["acc_hits"].tolist() == [0, 2, 1, 2] and m["acc_count"].tolist() == [0, 2, 2, 2]
    assert m["alpha_sum"].tolist() == [0, (1 + 5) / 16, (2 + 6) / 16, (3 + 7) / 16]  # valid slots only


@pytest.mark.parametrize("window, causal", [(None, False), (4, True)])
def test_eager_attention_equals_softmax_over_the_dense_mask(window, causal):
    torch.manual_seed(0)
    r, a, t, hq, hkv, d = 2, 3, 14, 4, 2, 8
    anchors = torch.tensor([[0, 5, 9], [3, 8, 8]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    doc = torch.tensor([[0] * 7 + [1] * 7, [0] * 4 + [1] * 10])
    q = torch.randn(r, a * B, hq, d)
    kc, vc = torch.randn(r, t, hkv, d), torch.randn(r, t, hkv, d)
    kb, vb = torch.randn(r, a * B, hkv, d), torch.randn(r, a * B, hkv, d)
    out = eager.anchored_attention(q, kc, vc, kb, vb, anchors, valid, doc, B, window, causal)
    mask = torch.stack([visible_keys(*row, B, window, causal) for row in zip(anchors, valid, doc)])  # spec.md §4 loops
    k = torch.cat([kc, kb], 1).repeat_interleave(hq // hkv, 2)
    v = torch.cat([vc, vb], 1).repeat_interleave(hq // hkv, 2)
    scores = torch.einsum("rqhd,rshd->rhqs", q, k) / d**0.5
    probs = torch.softmax(scores.masked_fill(~mask[:, None], float("-inf")), -1).nan_to_num(0.0)
    assert torch.allclose(out, torch.einsum("rhqs,rshd->rqhd", probs, v), atol=1e-5)
    assert not out[1, 2 * B :].any(), "an invalid anchor's block is zero"


def test_a_target_without_an_embedding_is_refused_by_name(tmp_path):
    """A truncated or foreign checkpoint: a one-line data error naming the target and the tensor, not a KeyError."""
    import json

    from safetensors.torch import save_file

    from dflash_fast.drafter.weights import load_frozen_tensors

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "tie_word_embeddings": True}))
    save_file({"model.norm.weight": torch.ones(8)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"none of .*embed_tokens.* found for the target's embed_tokens"):
        load_frozen_tensors(str(tmp_path))


# ---------------------------------------------------------------- one home per family
def test_each_family_is_built_as_its_own_modules_class():
    """DFlashDrafter(cfg) is the class of cfg.family, defined in that family's module (families.FAMILIES); DFlash
    is DFlashDrafter itself."""
    from dflash_fast.drafter import families

    assert type(DFlashDrafter(small_config())) is DFlashDrafter
    built = {"dspark": DFlashDrafter(small_config(markov_rank=4)),
             "dflash2": DFlashDrafter(small_config(selector_rank=8, selector_top_k=4)),
             "lilicorr": DFlashDrafter(small_config(lilicorr_candidate_topk=4, lilicorr_num_heads=2))}
    assert set(built) == set(families.FAMILIES) == set(DFlashDrafter.families)
    for name, drafter in built.items():
        assert drafter.config.family == name and type(drafter).family == name
        assert type(drafter).__module__ == families.FAMILIES[name].__name__
    with pytest.raises(ValueError, match="choose one family"):
        small_config(markov_rank=4, selector_rank=8)
