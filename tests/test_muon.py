"""optimizer.kind=muon: DeepSpeed's own Muon orthogonalises every trainable drafter matrix under each ZeRO stage
(checked against DeepSpeed's muon_update and against an independent Newton-Schulz written here from the published
algorithm), the norm weights take its auxiliary AdamW, the two pitfalls are refused, and stop + resume is exact.
Weight decay, under AdamW and under Muon's AdamW half alike, reaches the matrices only, as DeepSpeed receives it."""
import json
import os

import pytest
import torch
from deepspeed.runtime.zero.muon.original_muon import muon_update
from test_trainer import TINY_YAML, exported, losses, run, settings, tiny  # noqa: F401 (tiny is a fixture)

from dflash_fast.data.batches import make_loader
from dflash_fast.drafter.model import build_drafter
from dflash_fast.train import distributed, optim, trainer
from dflash_fast.train.config import ConfigError, load_config


@pytest.fixture(autouse=True)
def eager_muon():
    """DeepSpeed torch.compile's its Muon update: inductor on 2 CPU cores takes minutes, eager is the same math."""
    with torch._dynamo.config.patch(disable=True):
        yield


def ds_json(tmp_path, stage: int, **zero) -> str:
    """A DeepSpeed JSON of one ZeRO stage; ZeRO-3 partitions every parameter (no persistence threshold)."""
    if stage == 3:
        zero.setdefault("stage3_param_persistence_threshold", 0)
    path = tmp_path / f"ds_zero{stage}.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": stage, **zero}}))
    return str(path)


def gathered(engine):
    """name -> fp32 copy of each trainable module parameter (ZeRO-3 partitions gathered)."""
    import deepspeed

    params = {n: p for n, p in engine.module.named_parameters() if p.requires_grad}
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {n: p.detach().float().clone() for n, p in params.items()}


def reference_gradients(t: trainer.Trainer, cfg):
    """The first step's gradients, computed in plain torch on a drafter built like the trainer's (same seed)."""
    torch.manual_seed(cfg.seed)
    ref = build_drafter(cfg.model.target or t.target, [1, 2], cfg.model.mask_token_id, num_layers=1,
                        block_size=cfg.model.block_size)
    batch = next(iter(make_loader(t.store, cfg.data, cfg.seed, 0, 1, 0, "train", with_last=True)))
    ref(batch, loss_kind=t.loss_kind, gamma=cfg.loss.gamma, noise_std=0.0, seed=0).loss.backward()
    return {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}, dict(ref.named_parameters())


def newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The orthogonalisation of Keller Jordan's Muon as published (github.com/KellerJordan/Muon): normalise by
    the Frobenius norm, transpose a tall matrix, then `steps` quintic iterations X <- a X + (b A + c A^2) X with
    A = X X^T and (a, b, c) = (3.4445, -4.7750, 2.0315). In float64, apart from any optimizer's code."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).float()


def muon_step(grad: torch.Tensor, momentum: torch.Tensor, beta: float, lr: float) -> torch.Tensor:
    """A matrix's change in one Muon step as published, with DeepSpeed's defaults (Nesterov, 5 iterations, no
    weight decay): momentum <- beta momentum + (1 - beta) grad (in place), the Nesterov look-ahead
    grad + beta (momentum - grad) orthogonalised, scaled by sqrt(max(1, rows / cols)), times -lr."""
    momentum.mul_(beta).add_(grad, alpha=1 - beta)
    look_ahead = grad + beta * (momentum - grad)
    return -lr * newton_schulz(look_ahead) * max(1.0, grad.shape[0] / grad.shape[1]) ** 0.5


@pytest.mark.parametrize("stage", [0, 1, 3], ids=["zero0", "zero1", "zero3-partitioned"])
def test_two_muon_steps_equal_an_independent_newton_schulz_with_nesterov_momentum(tiny, tmp_path, stage):  # noqa: F811
    """Two steps from the same weights and batches, each matrix's change against muon_step above (no DeepSpeed
    code): the second step carries the first one's momentum, so a Muon wired without momentum, with another
    momentum, without Nesterov, at another lr or onto other matrices fails here."""
    muon_lr, beta = 0.02, 0.95
    cfg = load_config(TINY_YAML, settings(tiny, str(tmp_path / "run"), optimizer__kind="muon",
                                          optimizer__muon_lr=muon_lr, optimizer__muon_momentum=beta,
                                          optimizer__grad_clip=0, schedule__warmup_ratio=0, schedule__kind="constant",
                                          schedule__steps=2, deepspeed=ds_json(tmp_path, stage)))
    distributed.quiet_deepspeed()
    t = trainer.Trainer(cfg, *distributed.init_distributed())
    torch.manual_seed(cfg.seed)
    ref = build_drafter(t.target, [1, 2], cfg.model.mask_token_id, num_layers=1, block_size=cfg.model.block_size)
    batches = iter(make_loader(t.store, cfg.data, cfg.seed, 0, 1, 0, "train", with_last=True))
    momenta = {}
    for step in (1, 2):
        before = gathered(t.engine)
        ref.zero_grad()
        with torch.no_grad():
            for name, p in ref.named_parameters():
                if name in before:
                    p.copy_(before[name])
        ref(next(batches), loss_kind=t.loss_kind, gamma=cfg.loss.gamma, noise_std=0.0, seed=0).loss.backward()
        t.train_step()
        after = gathered(t.engine)
        grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
        matrices = [n for n, w in before.items() if w.dim() == 2]
        assert len(matrices) == 8, matrices  # fc and the layer's q, k, v, o, gate, up, down projections
        for name in matrices:
            expected = muon_step(grads[name], momenta.setdefault(name, torch.zeros_like(grads[name])), beta, muon_lr)
            torch.testing.assert_close(after[name] - before[name], expected, rtol=0,
                                       atol=1e-3 * expected.abs().max().item(),
                                       msg=f"ZeRO-{stage} step {step} {name}: not the published Muon step")


@pytest.mark.parametrize("stage", [0, 1, 2, 3], ids=["zero0", "zero1", "zero2", "zero3-partitioned"])
def test_newton_schulz_ran_on_every_drafter_matrix(tiny, tmp_path, stage):  # noqa: F811
    """One step from the same weights and batch: each matrix moved by -muon_lr * NS(momentum(g)), the
    orthogonalised gradient, never by -lr * g (SGD) nor by AdamW's ~-lr * sign(g); each norm weight by AdamW."""
    muon_lr, adam_lr = 0.02, 3e-3
    cfg = load_config(TINY_YAML, settings(tiny, str(tmp_path / "run"), optimizer__kind="muon",
                                          optimizer__muon_lr=muon_lr, optimizer__lr=adam_lr,
                                          optimizer__grad_clip=0, schedule__warmup_ratio=0, schedule__steps=1,
                                          deepspeed=ds_json(tmp_path, stage)))
    distributed.quiet_deepspeed()
    t = trainer.Trainer(cfg, *distributed.init_distributed())
    before = gathered(t.engine)
    grads, ref_params = reference_gradients(t, cfg)
    for name, w in before.items():
        assert torch.equal(w, ref_params[name].detach()), f"{name}: the reference drafter must start where the run does"
    t.train_step()
    after = gathered(t.engine)
    matrices = [n for n, w in before.items() if w.dim() == 2]
    assert {"fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"} <= set(matrices)
    for name, w in before.items():
        step, g = after[name] - w, grads[name]
        if w.dim() == 2:
            expected = -muon_lr * muon_update(g.clone(), torch.zeros_like(g), beta=cfg.optimizer.muon_momentum)
            torch.testing.assert_close(step, expected, rtol=0, atol=1e-3 * expected.abs().max().item(),
                                       msg=f"ZeRO-{stage} {name}: not the Muon update")
            # Independent of DeepSpeed's code: an orthogonalised update has its top singular value near 1.
            scale = max(1.0, w.shape[0] / w.shape[1]) ** 0.5
            top = torch.linalg.matrix_norm(step / (muon_lr * scale), ord=2).item()
            assert 0.5 < top < 1.5, f"ZeRO-{stage} {name}: top singular value {top} of the update"
        else:  # AdamW's first step moves every element by lr * g / (|g| + eps)
            torch.testing.assert_close(step, -adam_lr * g / (g.abs() + cfg.optimizer.eps), rtol=1e-3, atol=1e-7,
                                       msg=f"ZeRO-{stage} {name}: not AdamW's first step")


def optimizer_groups(engine):
    """(use_muon, weight_decay, parameter names) of each param group DeepSpeed's optimizer steps with. ZeRO-1/2
    flatten a group's parameters; their optimizer keeps which ones each group holds (bit16_groups)."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    groups = engine.basic_optimizer.param_groups
    members = getattr(engine.optimizer, "bit16_groups", None) or [g["params"] for g in groups]
    assert len(members) == len(groups)
    return [(g.get("use_muon"), g["weight_decay"], sorted(names[id(p)] for p in params))
            for g, params in zip(groups, members)]


@pytest.mark.parametrize("kind,stage", [("adamw", 0), ("adamw", 2), ("muon", 0), ("muon", 1)])
def test_weight_decay_reaches_every_matrix_and_never_a_norm_weight(tiny, tmp_path, kind, stage):  # noqa: F811
    """optimizer.weight_decay > 0: the param groups DeepSpeed's optimizer holds decay exactly the trainable
    matrices; the norm weights (hidden_norm, the layer norms, q/k norms, the final norm) sit in groups of weight
    decay 0: under AdamW, and under Muon in its auxiliary AdamW half (the matrices in its Muon half)."""
    cfg = load_config(TINY_YAML, settings(tiny, str(tmp_path / "run"), optimizer__kind=kind,
                                          optimizer__weight_decay=0.1, optimizer__grad_clip=0,
                                          deepspeed=ds_json(tmp_path, stage)))
    distributed.quiet_deepspeed()
    t = trainer.Trainer(cfg, *distributed.init_distributed())
    trainable = {n: p for n, p in t.engine.module.named_parameters() if p.requires_grad}
    matrices = {n for n, p in trainable.items() if p.dim() == 2}
    norms = set(trainable) - matrices
    assert {"hidden_norm.weight", "norm.weight", "layers.0.input_layernorm.weight"} <= norms and len(matrices) == 8
    groups = optimizer_groups(t.engine)
    held = [n for _, _, names in groups for n in names]
    assert sorted(held) == sorted(trainable), "every trainable parameter in exactly one group"
    decayed = {n for _, decay, names in groups if decay == 0.1 for n in names}
    undecayed = {n for _, decay, names in groups if decay == 0.0 for n in names}
    assert decayed == matrices and undecayed == norms, groups
    if kind == "muon":
        assert {n for use_muon, _, names in groups if use_muon for n in names} == matrices
        assert {n for use_muon, _, names in groups if use_muon is False for n in names} == norms


def test_muon_refuses_matrices_that_deepspeed_would_give_adamw(tiny, tmp_path, monkeypatch):  # noqa: F811
    """The zero.Init pitfall: parameters that read as 1-D when DeepSpeed tags them train on AdamW alone."""
    import deepspeed

    monkeypatch.setattr(deepspeed, "_layer_shape", lambda p: (p.numel(),))
    with pytest.raises(ConfigError, match=r"Muon/AdamW split does not follow the layer shapes \(fc\.weight \[32, 64\] "
                                          r"-> AdamW; layers\.0\.self_attn\.q_proj\.weight"):
        run(tiny, str(tmp_path / "run"), optimizer__kind="muon", optimizer__grad_clip=0,
            deepspeed=ds_json(tmp_path, 3))


def test_muon_under_zero0_refuses_a_plain_sgd_step(tiny, tmp_path, monkeypatch):  # noqa: F811
    """The ZeRO-0 pitfall: DeepSpeed releases that orthogonalise only ZeRO's flat partitions step whole matrices
    by SGD, with no Muon state; reintroduced here by such a step."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    def sgd_step(self, closure=None, step_id=None):  # noqa: ARG001 (the signature DeepSpeed calls)
        for group in self.param_groups:
            for p in group["params"]:
                p.data.add_(p.grad, alpha=-group["lr"])

    monkeypatch.setattr(MuonWithAuxAdam, "step", torch.no_grad()(sgd_step))
    with pytest.raises(ConfigError, match=r"under ZeRO-0: DeepSpeed's Muon did not orthogonalise fc\.weight, "):
        run(tiny, str(tmp_path / "run"), optimizer__kind="muon", optimizer__grad_clip=0,
            deepspeed=ds_json(tmp_path, 0))


def test_muon_config_refuses_what_deepspeed_would_do_differently(tmp_path):
    with pytest.raises(ConfigError, match=r"optimizer\.grad_clip=1\.0 with optimizer\.kind=muon: .* set "
                                          r"optimizer\.grad_clip=0"):
        load_config(TINY_YAML, ["optimizer.kind=muon", "optimizer.grad_clip=1.0"])
    with pytest.raises(ConfigError, match=r"optimizer\.kind='sgd' is not one of \('adamw', 'muon'\)"):
        load_config(TINY_YAML, ["optimizer.kind=sgd"])
    cfg = load_config(TINY_YAML, ["optimizer.kind=muon", "optimizer.grad_clip=0"])
    with pytest.raises(ConfigError, match=r"reduce_scatter=true, which DeepSpeed's Muon cannot use under ZeRO-3"):
        optim.deepspeed_config(ds_json(tmp_path, 3, reduce_scatter=True), cfg, "fp32")
    ds = optim.deepspeed_config(ds_json(tmp_path, 3), cfg, "fp32")
    assert ds["zero_optimization"]["reduce_scatter"] is False
    assert ds["optimizer"] == {"type": "Muon", "params": {
        "muon_lr": 0.02, "momentum": 0.95, "adam_lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0,
        "torch_adam": True}}
    with pytest.raises(ConfigError, match=r"under ZeRO-0 is supported in fp32 only"):
        optim.deepspeed_config(ds_json(tmp_path, 0), cfg, "bf16")


@pytest.mark.parametrize("stage", [1, 3], ids=["zero1", "zero3-partitioned"])
def test_muon_resume_from_a_checkpoint_equals_an_uninterrupted_run(tiny, tmp_path, stage):  # noqa: F811
    """The momentum buffers are in the checkpoint: steps 4-6 resumed from step 3 equal the uninterrupted ones."""
    common = dict(optimizer__kind="muon", optimizer__grad_clip=0, schedule__steps=6, schedule__grad_accum=2,
                  checkpoint__every=3, checkpoint__keep_last=2, deepspeed=ds_json(tmp_path, stage))
    whole = str(tmp_path / "whole")
    run(tiny, whole, **common)
    parts = str(tmp_path / "parts")
    run(tiny, parts, checkpoint__resume=os.path.join(whole, "checkpoints", "step00000003"), **common)
    assert sorted(losses(parts)) == [4, 5, 6]
    assert losses(parts) == {s: v for s, v in losses(whole).items() if s > 3}
    a, b = exported(whole), exported(parts)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_muon_leaves_embeddings_to_adamw_as_deepspeed_does_and_trains_a_lilicorr_drafter(tiny, tmp_path):  # noqa: F811
    """DeepSpeed's Muon gives AdamW every parameter named like an embedding (deepspeed/__init__.py's use_muon tagging),
    5-D LiLiCorr slot and rank embeddings included: check_muon and the memory plan follow that rule (check_muon
    refused the LiLiCorr drafter when it counted them as matrices)."""
    cfg = load_config(TINY_YAML, settings(tiny, str(tmp_path / "run"), optimizer__kind="muon", optimizer__grad_clip=0,
                                          model__lilicorr_candidate_topk=4, model__lilicorr_hidden_size=32,
                                          model__lilicorr_num_heads=2, model__lilicorr_factor_dim=16,
                                          deepspeed=ds_json(tmp_path, 1)))
    distributed.quiet_deepspeed()
    t = trainer.Trainer(cfg, *distributed.init_distributed())
    groups = optimizer_groups(t.engine)
    on_muon = {n for use_muon, _, names in groups if use_muon for n in names}
    on_adamw = {n for use_muon, _, names in groups if use_muon is False for n in names}
    assert {"lilicorr.slot_embedding", "lilicorr.rank_embedding"} <= on_adamw
    assert any(n.startswith("lilicorr.") for n in on_muon) and "fc.weight" in on_muon
    for name, p in t.engine.module.named_parameters():
        if p.requires_grad:
            assert (name in on_muon) == optim.takes_muon(name, p.shape), name
