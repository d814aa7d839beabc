"""The trainer on a store extracted without `last`: loss.kind auto is kl_topk, loss.gamma is not 7.

The first step's loss is recomputed by hand from the first batch (tests/oracles.py: spec.md §5's stored
top-k teacher at p - 1, weights exp(-(j - 1) / gamma), the mean over trained slots), and a run stopped
by SIGTERM and resumed reproduces the uninterrupted one step for step.
"""
import os
from types import SimpleNamespace

import pytest
import torch
from oracles import batch_loss, drafter_logits
from test_trainer import exported, records, stopped_by_sigterm
from tiny_targets import make_tiny_target, sample_records, write_jsonl

from dflash_fast.data.batches import make_loader
from dflash_fast.data.config import DataConfig
from dflash_fast.drafter.model import build_drafter
from dflash_fast.extract.extract import extract
from dflash_fast.store.reader import HiddenStateStore
from dflash_fast.train import trainer
from dflash_fast.train.config import load_config
from dflash_fast.train.distributed import init_distributed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_YAML = os.path.join(REPO, "configs", "tiny.yaml")
BLOCK, GAMMA, MASK_TOKEN, LAYER_IDS = 4, 2.5, 383, [1, 2]
SEQ_LEN, ANCHORS, ROWS, STEPS = 64, 8, 2, 6


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A 4-layer Qwen3 target (H = 32, V = 384) and an fp32 store without `last`, top-4 teacher."""
    root = tmp_path_factory.mktemp("no_last")
    target = make_tiny_target(root / "target", num_layers=4, hidden_size=32)
    write_jsonl(root / "data.jsonl", sample_records(40))
    extract(target, root / "data.jsonl", root / "store", layer_ids=LAYER_IDS, dtype="fp32", max_seq_len=SEQ_LEN,
            topk=4, no_last=True, progress=False)
    return SimpleNamespace(target=str(target), path=str(root / "store"))


def config(store, out, **extra):
    values = {
        "data.store": store.path,
        "output_dir": out,
        "model.mask_token_id": MASK_TOKEN,
        "model.num_layers": 1,
        "model.block_size": BLOCK,
        "data.seq_len": SEQ_LEN,
        "data.num_anchors": ANCHORS,
        "data.batch_rows": ROWS,
        "data.num_workers": 0,
        "data.val_fraction": 0.0,
        "data.noise_std": 0.0,
        "validation.every": 0,
        "logging.every": 1,
        "logging.progress": False,
        "checkpoint.every": 0,
        "schedule.steps": STEPS,
        "optimizer.lr": 3e-3,
        "optimizer.kind": "adamw",
        "optimizer.grad_clip": 1.0,
        "loss.kind": "auto",
        "loss.weighting": "decay",
        "loss.gamma": GAMMA,
        "export_dtype": "fp32",
        "deepspeed": os.path.join(REPO, "configs", "ds_zero2.json"),
        **extra,
    }
    return load_config(TINY_YAML, [f"{k}={v}" for k, v in values.items()])


@pytest.fixture(scope="module")
def uninterrupted(store, tmp_path_factory):
    """One run of STEPS steps, with the drafter's weights as they were before step 1."""
    out = str(tmp_path_factory.mktemp("whole"))
    run = trainer.Trainer(config(store, out), *init_distributed())
    initial = {name: p.detach().clone() for name, p in run.engine.module.named_parameters()}
    loss_kind = run.loss_kind
    run.run()
    return SimpleNamespace(out=out, initial=initial, loss_kind=loss_kind)


def test_first_step_loss_is_the_hand_computed_kl_topk_loss_of_the_first_batch(store, uninterrupted):
    assert not HiddenStateStore(store.path).manifest["has_last"]
    assert uninterrupted.loss_kind == "kl_topk", "loss.kind auto on a store without `last`"
    drafter = build_drafter(store.target, LAYER_IDS, MASK_TOKEN, num_layers=1, block_size=BLOCK)
    drafter.load_state_dict(uninterrupted.initial)
    # The first micro-batch of epoch 0 on rank 0 of 1, as the trainer's config asks for it.
    loader = make_loader(HiddenStateStore(store.path), DataConfig(seq_len=SEQ_LEN, num_anchors=ANCHORS, batch_rows=ROWS,
                         num_workers=0), seed=0, rank=0, world_size=1, epoch=0)
    batch = next(iter(loader))
    assert "last" not in batch and batch["anchor_valid"].any()
    with torch.no_grad():
        logits = drafter_logits(drafter, batch, drafter.config.rms_norm_eps)
    loss, kl = batch_loss("kl_topk", batch, logits, BLOCK, GAMMA, eps=drafter.config.rms_norm_eps)
    first = records(uninterrupted.out)[0]
    assert first["step"] == 1
    assert first["loss"] == pytest.approx(float(loss), rel=1e-5)
    assert first["kl"] == pytest.approx(float(kl), rel=1e-4)


def test_stop_and_resume_equals_the_uninterrupted_kl_topk_run(store, uninterrupted, tmp_path):
    parts = str(tmp_path / "parts")
    stopped = stopped_by_sigterm(lambda: trainer.train(config(store, parts)), 3)
    assert stopped["interrupted"] and stopped["step"] == 3
    resumed = trainer.train(config(store, parts, **{"checkpoint.resume": "latest"}))
    assert resumed["step"] == STEPS and not resumed["interrupted"]
    whole = {r["step"]: (r["loss"], r["kl"]) for r in records(uninterrupted.out)}
    assert {r["step"]: (r["loss"], r["kl"]) for r in records(parts)} == whole
    assert sorted(whole) == list(range(1, STEPS + 1))
    a, b = exported(uninterrupted.out), exported(parts)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
