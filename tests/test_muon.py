"""optimizer.kind=muon: DeepSpeed's own Muon orthogonalises every trainable drafter matrix under each ZeRO stage,
the norm weights take its auxiliary AdamW, the two pitfalls are refused, and stop + resume is exact."""
import json
import os

import pytest
import torch
from deepspeed.runtime.zero.muon.original_muon import muon_update
from test_trainer import TINY_YAML, exported, losses, run, settings, tiny  # noqa: F401 (tiny is a fixture)

from dflash_fast import distributed, optim, trainer
from dflash_fast.batches import make_loader
from dflash_fast.config import ConfigError, load_config
from dflash_fast.drafter import build_drafter


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
    d = cfg.data
    batch = next(iter(make_loader(t.store, d.seq_len, d.num_anchors, d.batch_rows, cfg.seed, 0, 1, 0, "train",
                                  val_fraction=d.val_fraction, split_seed=d.split_seed, with_last=True)))
    ref(batch, loss_kind=t.loss_kind, gamma=cfg.loss.gamma, noise_std=0.0, seed=0).loss.backward()
    return {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}, dict(ref.named_parameters())


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
    t = trainer.Trainer(cfg, *trainer.init_distributed())
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
