"""Online mode (data.source=online): the target runs in the training job and hands the drafter exactly the batches,
losses and gradients a store extracted from the same JSONL would; stop + resume (SIGTERM, kill -9) stays exact."""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from launch_env import launch_env
from test_trainer import STOP_AND_RESUME, exported, losses, records, stopped_by_sigterm
from test_trainer import settings as trainer_settings
from tiny_targets import make_tiny_target, sample_records, write_jsonl

from dflash_fast import cli
from dflash_fast.data.config import OnlineConfig
from dflash_fast.data.online import OnlineBatches
from dflash_fast.extract.extract import extract, options_of
from dflash_fast.extract.plan import ExtractOptions, ExtractSettings
from dflash_fast.train import trainer
from dflash_fast.train.config import ConfigError, load_config
from dflash_fast.train.data import TrainStream, extraction_options, open_batches, open_source
from dflash_fast.train.distributed import init_distributed
from dflash_fast.train.trainer import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_YAML = os.path.join(REPO, "configs", "tiny.yaml")
LAYER_IDS = [1, 2]
MAX_SEQ_LEN = 64
# Equal up to float rounding: a store's forwards pad each document into other batches than an online step's, and a
# BLAS may round a row differently in a matrix of another height. Bounded by test_extract's batched-vs-alone
# tolerance (1e-5 relative) for the tapped states; the drafter's loss and gradients are smooth in them and move by
# the same order, so 1e-4 leaves ten times that, while a real difference (another layer, `last` after the norm,
# other anchors or rows) moves them by 1e-2 or more. Measured here (CPU, fp32): 0, bit-equal, in both cases. With
# batch_tokens = 1 on both sides the forwards are the same calls, and the test asserts bit-equality.
RTOL, ATOL = 1e-4, 1e-6


_TINY = {}


def make_tiny(arch, tmp_path_factory):
    """A 4-layer tiny target of `arch` and its JSONL; fp32 stores extracted with every document alone (`alone`)
    and in padded batches (`batched`). Built once per module and arch."""
    if arch not in _TINY:
        root = tmp_path_factory.mktemp(f"online_{arch}")
        target = make_tiny_target(root / "target", arch, num_layers=4, hidden_size=32)
        data = write_jsonl(root / "data.jsonl", sample_records(40))
        stores = {}
        for name, batch_tokens in (("alone", 1), ("batched", 16384)):
            stores[name] = str(root / f"store_{name}")
            extract(target, data, stores[name], layer_ids=LAYER_IDS, dtype="fp32", max_seq_len=MAX_SEQ_LEN,
                    batch_tokens=batch_tokens, progress=False)
        _TINY[arch] = SimpleNamespace(root=root, arch=arch, target=str(target), data=str(data), stores=stores)
    return _TINY[arch]


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def tiny_any(request, tmp_path_factory):
    """The dense Qwen3 and the hybrid Qwen3.5 (linear-attention layers) tiny targets."""
    return make_tiny(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The dense tiny target only: what does not depend on the architecture runs once."""
    return make_tiny("qwen3", tmp_path_factory)


def settings(tiny, out, source, batch_tokens=16384, **extra):
    """test_trainer's overrides (configs/tiny.yaml for a run of seconds) with the data from the store extracted with
    `batch_tokens`, or online from the JSONL with the same extraction settings."""
    store = SimpleNamespace(store=tiny.stores["alone" if batch_tokens == 1 else "batched"])
    if source == "online":
        extra = {
            "data.source": "online",
            "data.jsonl": tiny.data,
            "model.target": tiny.target,
            "model.layer_ids": ",".join(map(str, LAYER_IDS)),
            "data.online.max_seq_len": MAX_SEQ_LEN,
            "data.online.dtype": "fp32",
            "data.online.batch_tokens": batch_tokens,
            **extra,
        }
    return trainer_settings(store, out, **extra)


def config(tiny, out, source, **extra):
    return load_config(TINY_YAML, settings(tiny, out, source, **extra))


def assert_same_batch(a, b, exact=False):
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        if exact or not a[key].is_floating_point():
            assert torch.equal(a[key], b[key]), key
        else:
            torch.testing.assert_close(b[key], a[key], rtol=RTOL, atol=ATOL, msg=key)


def first_step(cfg, monkeypatch):
    """One optimizer step of a Trainer built from `cfg` -> (its micro-batches, loss, the gradient of every
    trainable parameter as the optimizer receives it). ZeRO stage 0: the gradients stay in `.grad`."""
    t = trainer.Trainer(cfg, *init_distributed())
    batches, grads = [], {}
    real_next, real_step = TrainStream.__next__, t.engine.step

    def keep_batch(stream):
        batches.append(real_next(stream))
        return batches[-1]

    def keep_grads():
        grads.update({n: p.grad.detach().clone() for n, p in t.engine.module.named_parameters() if p.grad is not None})
        return real_step()

    monkeypatch.setattr(TrainStream, "__next__", keep_batch)
    monkeypatch.setattr(t.engine, "step", keep_grads)
    try:
        sums, _, _ = t.train_step()
    finally:
        t.stream.close()
        monkeypatch.undo()
    return batches, sums.metrics(False)["loss"], grads


@pytest.fixture(scope="module")
def zero0(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds") / "ds_zero0.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    return str(path)


# ---------------------------------------------------------------- the same step


@pytest.mark.parametrize("batching", ["alone", "batched"])
def test_one_online_step_equals_one_store_step_loss_and_every_gradient(tiny_any, tmp_path, zero0, batching,
                                                                       monkeypatch):
    tiny = tiny_any
    bt = 1 if batching == "alone" else 16384
    common = dict(batch_tokens=bt, deepspeed=zero0, schedule__grad_accum=2, data__noise_std=0.05)
    store = first_step(config(tiny, str(tmp_path / "store"), "store", **common), monkeypatch)
    online = first_step(config(tiny, str(tmp_path / "online"), "online", **common), monkeypatch)
    (store_batches, store_loss, store_grads), (online_batches, online_loss, online_grads) = store, online
    assert len(store_batches) == len(online_batches) == 2
    exact = batching == "alone"
    for a, b in zip(store_batches, online_batches):
        assert "last" in a  # loss.kind auto -> kl: `last` is produced online too
        assert_same_batch(a, b, exact)
    assert store_grads.keys() == online_grads.keys() and len(store_grads) > 5
    if exact:
        assert online_loss == store_loss
        assert all(torch.equal(online_grads[n], g) for n, g in store_grads.items())
    else:
        assert online_loss == pytest.approx(store_loss, rel=RTOL)
        for name, g in store_grads.items():
            torch.testing.assert_close(online_grads[name], g, rtol=RTOL, atol=ATOL * g.abs().max().item(), msg=name)


def test_online_batches_follow_the_store_through_epochs_and_validation(tiny, tmp_path):
    """Every micro-batch of two epochs (rows reshuffled, anchors redrawn) and of the val split, one step ahead."""
    extra = dict(data__val_fraction=0.1, data__batch_rows=1)
    store_cfg = config(tiny, str(tmp_path), "store", **extra)
    online_cfg = config(tiny, str(tmp_path), "online", **extra)
    store, online = open_source(store_cfg), open_source(online_cfg)
    assert (online.lengths == store.lengths).all() and online.manifest["num_tokens"] == store.manifest["num_tokens"]
    assert online.manifest["layer_ids"] == store.manifest["layer_ids"] and online.manifest["has_last"]
    assert online.manifest["extraction"]["job"] == store.manifest["extraction"]["job"], "the same job: same data"
    for split, epoch in (("train", 0), ("train", 1), ("val", 0)):
        a = open_batches(store, store_cfg, 0, 1, split, True, epoch)
        b = open_batches(online, online_cfg, 0, 1, split, True, epoch)
        assert isinstance(b, OnlineBatches)
        pairs = list(zip(a, b, strict=True))
        assert len(pairs) >= 3
        for x, y in pairs:
            assert_same_batch(x, y)
        assert b.take_target_seconds() > 0
        b.close()


def test_online_fp8_batches_equal_an_fp8_store_s(tiny, tmp_path):
    store_dir = str(tmp_path / "fp8")
    extract(tiny.target, tiny.data, store_dir, layer_ids=LAYER_IDS, dtype="fp8", max_seq_len=MAX_SEQ_LEN,
            progress=False)
    store_cfg = config(tiny, str(tmp_path), "store", data__store=store_dir)
    online_cfg = config(tiny, str(tmp_path), "online", data__online__dtype="fp8")
    store, online = open_source(store_cfg), open_source(online_cfg)
    assert online.manifest["dtype"] == store.manifest["dtype"] == "float8_e4m3fn"
    a = open_batches(store, store_cfg, 0, 1, "train", True)
    b = open_batches(online, online_cfg, 0, 1, "train", True)
    for x, y in zip(a, b, strict=True):
        assert x["hidden"].dtype == torch.bfloat16  # dequantised by the loader on both paths
        assert_same_batch(x, y)
    b.close()


def test_online_training_matches_the_store_and_reports_target_and_drafter_time(tiny, tmp_path):
    store_out, online_out = str(tmp_path / "store"), str(tmp_path / "online")
    train(config(tiny, store_out, "store"))
    result = train(config(tiny, online_out, "online"))
    assert result["export"] and not result["interrupted"]
    assert losses(online_out) == pytest.approx(losses(store_out), rel=RTOL)
    for r in records(online_out):
        assert r["time_target_forward_ms"] > 0 and r["time_drafter_ms"] > 0
        assert r["time_drafter_ms"] == pytest.approx(r["time_forward_ms"] + r["time_backward_ms"]
                                                     + r["time_optimizer_ms"], rel=1e-6)
    assert all("time_target_forward_ms" not in r and r["time_drafter_ms"] > 0 for r in records(store_out))


def test_online_stop_by_sigterm_and_resume_equals_an_uninterrupted_run(tiny, tmp_path):
    # test_trainer's stopped and resumed run (STOP_AND_RESUME), online with prefetch on.
    whole, parts = str(tmp_path / "whole"), str(tmp_path / "parts")
    train(config(tiny, whole, "online", **STOP_AND_RESUME))
    stopped = stopped_by_sigterm(lambda: train(config(tiny, parts, "online", **STOP_AND_RESUME)), 5)
    assert stopped["interrupted"] and stopped["step"] == 5
    resumed = train(config(tiny, parts, "online", checkpoint__resume="latest", **STOP_AND_RESUME))
    assert resumed["step"] == 9 and not resumed["interrupted"]
    assert losses(parts) == losses(whole), "stop + resume must reproduce the uninterrupted losses step for step"
    assert records(parts)[4]["epoch"] < 1 < records(parts)[-1]["epoch"], "the resumed part must cross an epoch"
    a, b = exported(whole), exported(parts)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_online_resume_after_kill_9_equals_an_uninterrupted_run(tiny, tmp_path):
    from dflash_fast.train.checkpoint import checkpoint_tags

    common = dict(schedule__steps=9, checkpoint__every=2, checkpoint__keep_last=1)
    whole, parts = str(tmp_path / "whole"), str(tmp_path / "parts")
    train(config(tiny, whole, "online", **common))
    env = launch_env()
    env.update(OMP_NUM_THREADS=str(torch.get_num_threads()), PYTHONPATH=REPO)
    cmd = [sys.executable, os.path.join(REPO, "train.py"), "--config", TINY_YAML, *settings(tiny, parts, "online",
                                                                                          **common)]
    log = tmp_path / "killed.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 600
        while not any(int(t[4:]) >= 4 for t in checkpoint_tags(os.path.join(parts, "checkpoints"))):
            assert proc.poll() is None, f"the run ended before it could be killed: {log.read_text()[-3000:]}"
            assert time.time() < deadline, f"no checkpoint at step 4 within 600 s: {log.read_text()[-3000:]}"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)  # no handler runs: whatever the step was doing is cut off
    finally:
        proc.wait()
    killed_at = int(checkpoint_tags(os.path.join(parts, "checkpoints"))[-1][4:])
    assert 4 <= killed_at < 9 and not os.path.exists(os.path.join(parts, "export"))
    resumed = train(config(tiny, parts, "online", checkpoint__resume="latest", **common))
    assert resumed["step"] == 9
    assert losses(parts) == losses(whole), "kill -9 + resume must reproduce the uninterrupted losses step for step"
    a, b = exported(whole), exported(parts)
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- config


@pytest.mark.parametrize("overrides, match", [
    (["data.source=online", "data.jsonl=x.jsonl"], r"data.source=online needs model.target"),
    (["data.source=online", "model.target=t"], r"data.source=online needs data.jsonl=FILE"),
    (["data.source=online", "model.target=t", "data.jsonl=x", "data.online.dtype=int8"], r"data.online.dtype='int8'"),
    (["data.source=disk"], r"data.source='disk' is not one of \('store', 'online', 'vllm', 'vllm_serve'\)"),
    (["data.source=vllm", "data.jsonl=x.jsonl"], r"data.source=vllm needs model.target"),
    (["data.online.max_seq_len=1", "data.source=online", "model.target=t", "data.jsonl=x"], r"max_seq_len=1"),
])
def test_online_config_is_validated_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(TINY_YAML, overrides)
    assert load_config(TINY_YAML, ["data.source=online", "model.target=t", "data.jsonl=x"]).data.online.prefetch


# Every ExtractOptions field but the settings, by who fills it in a training run: extraction_options from the run's
# config (model.layer_ids, the loss kind, the source, data.*), or nobody (extract's own: their defaults online).
FROM_THE_RUN = {"layer_ids": [1, 2], "no_last": True, "engine": "vllm", "split": "test", "max_samples": 3,
                "reasoning": "mask"}
EXTRACT_ONLY = ("num_tapped", "shard_tokens", "trust_remote_code", "tensor_parallel_size")
# A value other than the default for each extraction setting (data.online.* and the extract flag of the same name).
NOT_DEFAULT = {"max_seq_len": 77, "batch_tokens": 999, "dtype": "fp8", "topk": 3, "parity_every": 7,
               "skip_bad": True}


def test_an_extraction_setting_is_one_field_of_both_extract_and_data_online():
    """A setting added to ExtractSettings is at once a data.online key, an extract flag with the same default and
    what extraction_options hands an online source; an option added to ExtractOptions alone has to be placed (in
    FROM_THE_RUN or EXTRACT_ONLY), and a data.online key that is an extract option has to be a setting."""
    settings = [f.name for f in dataclasses.fields(ExtractSettings)]
    options = [f.name for f in dataclasses.fields(ExtractOptions)]
    assert sorted(NOT_DEFAULT) == sorted(settings), "give a new setting a value other than its default here"
    assert sorted(options) == sorted([*settings, *FROM_THE_RUN, *EXTRACT_ONLY]), \
        "a new extract option: is it a data.online setting (ExtractSettings), the run's (extraction_options), or " \
        "extract's own?"
    online = [f.name for f in dataclasses.fields(OnlineConfig)]
    assert online[:len(settings)] == settings and not set(online[len(settings):]) & set(options)

    default = ExtractOptions()
    for command, flags in (("extract", options), ("serve-target", ())):
        parsed = vars(cli.command_parser(command)[1].parse_args(
            ["--target", "t", "--data", "d", "--out", "o"] if command == "extract" else ["--target", "t"]))
        assert set(flags) <= set(parsed), f"dflash-fast {command} lacks a flag of every ExtractOptions field"
        for name in set(options) & set(parsed):
            assert parsed[name] == getattr(default, name), f"{command} --{name.replace('_', '-')}'s default"
        assert options_of(SimpleNamespace(**parsed)) == {k: parsed[k] for k in options if k in parsed}

    cfg = load_config(TINY_YAML, [
        "data.source=vllm", "model.target=t", "data.jsonl=x", "model.layer_ids=1,2", "loss.kind=ce",
        "data.split=test", "data.max_samples=3", "data.reasoning=mask",
        *(f"data.online.{k}={v}" for k, v in NOT_DEFAULT.items())])
    got = extraction_options(cfg)
    assert {k: getattr(got, k) for k in settings} == NOT_DEFAULT == cfg.data.online.settings()
    assert {k: getattr(got, k) for k in FROM_THE_RUN} == FROM_THE_RUN
    assert all(getattr(got, k) == getattr(default, k) for k in EXTRACT_ONLY)


def test_online_with_a_missing_jsonl_names_it(tiny, tmp_path):
    with pytest.raises(ValueError, match=r"data.source=online over data.jsonl=.*nope.jsonl"):
        open_source(config(tiny, str(tmp_path), "online", data__jsonl=str(tmp_path / "nope.jsonl")))
