"""The DeepSpeed trainer on a tiny store: loss falls, 2 ranks == 1 rank, ZeRO-1/2/3 agree,
stop + resume == uninterrupted, and every failure says what is wrong."""
import json
import os
import shutil
import signal
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import psutil
import pytest
import torch
from launch_env import launch_env
from safetensors.torch import load_file
from tiny_targets import make_tiny_target, sample_records, write_jsonl

from dflash_fast.drafter.model import build_drafter
from dflash_fast.extract.extract import extract
from dflash_fast.store.reader import HiddenStateStore
from dflash_fast.train import trainer
from dflash_fast.train.checkpoint import checkpoint_tags, load_drafter_for_export
from dflash_fast.train.config import ConfigError, load_config
from dflash_fast.train.distributed import free_port
from dflash_fast.train.model import StoreMismatch, check_store_matches
from dflash_fast.train.optim import deepspeed_config, lr_multiplier
from dflash_fast.train.trainer import NonFiniteLoss, train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_YAML = os.path.join(REPO, "configs", "tiny.yaml")
BLOCK = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 4-layer Qwen3 target (H = 32, V = 384) and an fp32 store of ~30 short documents tapping layers 1, 2."""
    root = tmp_path_factory.mktemp("trainer")
    target = make_tiny_target(root / "target", num_layers=4, hidden_size=32)
    write_jsonl(root / "data.jsonl", sample_records(40))
    extract(target, root / "data.jsonl", root / "store", layer_ids=[1, 2], dtype="fp32", max_seq_len=64, progress=False)
    return SimpleNamespace(root=root, target=str(target), store=str(root / "store"))


def settings(tiny, out, **extra):
    """Overrides of configs/tiny.yaml for a run of a few seconds: 2 rows of 64 tokens, 8 anchors, blocks of 4."""
    values = {
        "data.store": tiny.store,
        "output_dir": out,
        "model.mask_token_id": 383,
        "model.num_layers": 1,
        "model.block_size": BLOCK,
        "data.seq_len": 64,
        "data.num_anchors": 8,
        "data.batch_rows": 2,
        "data.num_workers": 0,
        "data.val_fraction": 0.0,
        "validation.every": 0,
        "logging.every": 1,
        "logging.progress": False,
        "checkpoint.every": 0,
        "schedule.steps": 4,
        "optimizer.lr": 3e-3,
        "optimizer.kind": "adamw",  # tiny.yaml ships the quickstart's recipe (Muon, D-PACE): these tests pin AdamW
        "optimizer.grad_clip": 1.0,
        "loss.weighting": "decay",
        "export_dtype": "fp32",
        "deepspeed": os.path.join(REPO, "configs", "ds_zero2.json"),
    }
    values.update({k.replace("__", "."): v for k, v in extra.items()})
    return [f"{k}={v}" for k, v in values.items()]


def run(tiny, out, **extra):
    return train(load_config(TINY_YAML, settings(tiny, out, **extra)))


def records(out, split="train"):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["split"] == split]


def losses(out):
    return {r["step"]: r["loss"] for r in records(out)}


def exported(out):
    return load_file(os.path.join(out, "export", "model.safetensors"))


# Overrides for a run stopped by SIGTERM during step 5 and resumed: two micro-batches a step, hidden-state noise,
# checkpoints every 2 steps (the newest kept), and an epoch boundary after the stop.
STOP_AND_RESUME = dict(
    schedule__steps=9,
    schedule__grad_accum=2,
    data__noise_std=0.05,
    checkpoint__every=2,
    checkpoint__keep_last=1,
)


def stopped_by_sigterm(start, during_step, before_signal=None):
    """`start()`, a training run in this process, sent SIGTERM as step `during_step` begins (after `before_signal()`
    if given), as a launcher or scheduler stops a job; returns what `start` returns."""
    real_step = trainer.Trainer.train_step

    def signalled(self):
        if self.step == during_step - 1:
            if before_signal is not None:
                before_signal()
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer.Trainer, "train_step", signalled)
        return start()


# ---------------------------------------------------------------- config


def test_unknown_config_keys_are_refused_by_name(tmp_path, capsys):
    yaml_path = tmp_path / "bad.yaml"
    yaml_path.write_text("optimizer:\n  lrr: 1.0e-3\n")
    with pytest.raises(ConfigError, match=r"'optimizer\.lrr' in .*bad\.yaml; did you mean 'lr'"):
        load_config(str(yaml_path))
    with pytest.raises(ConfigError, match=r"'data\.stor' in the command-line overrides; did you mean 'store'"):
        load_config(TINY_YAML, ["data.stor=/x"])
    with pytest.raises(ConfigError, match=r"data\.seq_len: expected an integer, got 'long'"):
        load_config(TINY_YAML, ["data.seq_len=long"])
    with pytest.raises(SystemExit) as stop:
        trainer.main(["--config", TINY_YAML, "optimiser.lr=1e-3"])
    assert stop.value.code == 2
    assert "unknown config key 'optimiser'" in capsys.readouterr().err


def test_overrides_are_typed_like_the_yaml():
    cfg = load_config(
        TINY_YAML,
        ["optimizer.lr=3e-4", "model.layer_ids=1,9,17", "optimizer.betas=[0.8,0.9]", "logging.tensorboard=false"],
    )
    assert cfg.optimizer.lr == 3e-4 and cfg.model.layer_ids == [1, 9, 17] and cfg.optimizer.betas == (0.8, 0.9)
    assert cfg.logging.tensorboard is False


def test_deepspeed_json_may_not_set_what_the_yaml_owns(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5}))
    with pytest.raises(ConfigError, match=r"sets 'gradient_clipping'; set optimizer\.grad_clip in the YAML"):
        deepspeed_config(str(path), load_config(TINY_YAML), "fp32")


@pytest.mark.parametrize("text, message", [("[1, 2]", "holds a list, not a DeepSpeed config object"),
                                           ("[" * 100_000, "is not valid JSON")])
def test_a_deepspeed_json_that_is_no_object_is_one_config_error_naming_the_file(tmp_path, text, message):
    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"{path} {message}"):
        deepspeed_config(str(path), load_config(TINY_YAML), "fp32")


def test_lr_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    lrs = [lr_multiplier(k, 100, 4, "cosine", 0.1) for k in range(100)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a > b for a, b in zip(lrs[4:], lrs[5:])), "cosine decays monotonically after warmup"
    assert lrs[52] == pytest.approx(0.55, abs=0.02) and lrs[-1] == pytest.approx(0.1, abs=1e-3)


# ---------------------------------------------------------------- checks before step 1


def test_store_drafter_mismatch_names_both_values(tiny, tmp_path):
    with pytest.raises(StoreMismatch, match=r"layer ids: the store has \[1, 2\], the drafter has \[0, 2\]"):
        run(tiny, str(tmp_path / "ids"), model__layer_ids="[0,2]")
    other = tmp_path / "other_target"
    shutil.copytree(tiny.target, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(config, rms_norm_eps=1e-5)))
    with pytest.raises(
        StoreMismatch, match=r"target fingerprint .*: the store has [0-9a-f]{64}, the drafter has [0-9a-f]{64}"
    ):
        run(tiny, str(tmp_path / "fp"), model__target=str(other))
    store = HiddenStateStore(tiny.store)
    manifest = dict(store.manifest, hidden_size=48, vocab_size=500)
    drafter_config = build_drafter(tiny.target, [1, 2], 383, num_layers=1).config
    with pytest.raises(StoreMismatch) as err:
        check_store_matches(tiny.store, manifest, drafter_config, tiny.target, "kl")
    assert "target hidden size: the store has 48, the drafter has 32" in str(err.value)
    assert "vocabulary size: the store has 500, the drafter has 384" in str(err.value)


# ---------------------------------------------------------------- training


def test_loss_falls_and_the_export_holds_the_trained_weights(tiny, tmp_path):
    out = str(tmp_path / "run")
    result = run(tiny, out, schedule__steps=40, optimizer__lr=1e-2, data__val_fraction=0.1, validation__every=10)
    # The soft CE is the teacher's entropy (~5 nats for this random target, no gradient) plus the KL the drafter learns.
    kl = [r["kl"] for r in records(out)]
    assert len(kl) == 40 and np.mean(kl[-5:]) < 0.7 * np.mean(kl[:5]), f"the KL did not fall: {kl}"
    val = [r["loss"] for r in records(out, "val")]  # the same held-out batches every time
    assert len(val) == 4 and all(a > b for a, b in zip(val, val[1:])), f"the held-out loss did not fall: {val}"
    record = records(out)[-1]
    for key in [
        "loss",
        "kl",
        "tau_offline",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "anchors_per_s",
        "time_fetch_ms",
        "time_forward_ms",
        "time_backward_ms",
        "time_optimizer_ms",
        "peak_memory_mb",
    ] + [f"acc_{j}" for j in range(1, BLOCK)]:
        assert record[key] is not None, key
    assert result["export"] == os.path.join(out, "export") and not result["interrupted"]
    drafter, verifier = load_drafter_for_export(out)
    assert verifier == tiny.target
    weights = exported(out)
    for name, p in drafter.named_parameters():
        assert torch.equal(p, weights[name]), name


def test_loss_weighting_dpace_reaches_the_loss(tiny, tmp_path, monkeypatch):
    from dflash_fast.drafter import ops
    from dflash_fast.drafter.losses import DPace

    calls = []
    loss_fn = ops.lm_head_loss

    def spy(*args, **kwargs):
        calls.append((args[3].detach().clone(), args[8]))
        return loss_fn(*args, **kwargs)

    monkeypatch.setattr(ops, "lm_head_loss", spy)
    out = str(tmp_path / "dpace")
    run(tiny, out, schedule__steps=2, loss__weighting="dpace", loss__dpace_alpha=0.3)
    assert calls and all(dpace == DPace(0.3, BLOCK) for _, dpace in calls)
    assert all(set(weights.unique().tolist()) == {0.0, 1.0} for weights, _ in calls), "D-PACE weights the slot mask"
    calls.clear()
    decay = str(tmp_path / "decay")
    run(tiny, decay, schedule__steps=2)
    assert calls and all(dpace is None for _, dpace in calls)
    assert losses(out)[1] != pytest.approx(losses(decay)[1], rel=1e-3)


def test_loss_kind_reaches_the_loss_and_alpha_per_slot_is_logged(tiny, tmp_path, monkeypatch):
    """loss.kind=tv trains through ops.lm_head_loss, and metrics.jsonl holds alpha_j: the mean over the valid slots
    j of the loss's per-row acceptance estimate (LossOutput.alpha), next to the KL metric of the dense kinds."""
    from dflash_fast.drafter import ops

    seen = []
    loss_fn = ops.lm_head_loss

    def spy(*args, **kwargs):
        result = loss_fn(*args, **kwargs)
        seen.append((args[4], args[3].detach().clone(), result.alpha.detach().clone()))
        return result

    monkeypatch.setattr(ops, "lm_head_loss", spy)
    out = str(tmp_path / "tv")
    run(tiny, out, schedule__steps=2, loss__kind="tv")
    assert len(seen) == 2 and all(kind == "tv" for kind, _, _ in seen)
    _, weights, alpha = seen[0]  # step 1: one micro-batch
    mask = (weights > 0).view(-1, BLOCK)
    expected = (alpha.view(-1, BLOCK) * mask).sum(0) / mask.sum(0)
    record = records(out)[0]
    assert [record[f"alpha_{j}"] for j in range(1, BLOCK)] == pytest.approx(expected[1:].tolist(), rel=1e-5)
    assert 0 < min(expected[1:]) and max(expected[1:]) < 1
    assert record["kl"] is not None


def test_tensorboard_holds_the_metrics_jsonl_scalars(tiny, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = str(tmp_path / "run")
    run(
        tiny,
        out,
        schedule__steps=3,
        logging__tensorboard="true",
        data__val_fraction=0.1,
        validation__every=3,
        export="false",
    )
    events = EventAccumulator(os.path.join(out, "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/kl", "train/tau_offline", "train/lr", "val/loss", "val/tau_offline"} <= tags, tags
    logged = {e.step: e.value for e in events.Scalars("train/loss")}
    assert logged == pytest.approx(losses(out), rel=1e-6)
    assert [e.step for e in events.Scalars("val/loss")] == [r["step"] for r in records(out, "val")]


def test_stop_by_sigterm_and_resume_equals_an_uninterrupted_run(tiny, tmp_path):
    # STOP_AND_RESUME with a loader worker, which is signalled too.
    common = dict(STOP_AND_RESUME, data__num_workers=1)
    whole = str(tmp_path / "whole")
    run(tiny, whole, **common)

    parts = str(tmp_path / "parts")

    def signal_the_loader_workers():  # like a launcher or scheduler: SIGTERM to the loader workers and to this rank
        workers = psutil.Process().children()
        assert workers, "the loader worker must be running to be signalled"
        for worker in workers:
            worker.send_signal(signal.SIGTERM)

    stopped = stopped_by_sigterm(lambda: run(tiny, parts, **common), 5, signal_the_loader_workers)
    assert stopped["interrupted"] and stopped["step"] == 5
    assert checkpoint_tags(os.path.join(parts, "checkpoints")) == ["step00000005"], (
        "keep_last=1 keeps the newest only"
    )
    with pytest.raises(ConfigError, match="already holds checkpoints .*pass --resume"):
        run(tiny, parts, **common)
    resumed = run(tiny, parts, checkpoint__resume="latest", **common)
    assert resumed["step"] == 9 and not resumed["interrupted"]
    assert losses(parts) == losses(whole), "stop + resume must reproduce the uninterrupted losses step for step"
    assert sorted(losses(parts)) == list(range(1, 10))
    assert records(parts)[4]["epoch"] < 1 < records(parts)[-1]["epoch"], "the resumed part must cross an epoch boundary"
    a, b = exported(whole), exported(parts)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tiny, tmp_path, monkeypatch):
    # A NaN in the store is dropped at load (tests/test_nonfinite.py): the loss turns NaN from step 3 on instead.
    real_forward = trainer.Trainer._forward

    def nan_from_step_3(self, *args):
        out = real_forward(self, *args)
        return out._replace(loss=out.loss * float("nan")) if self.step >= 3 else out

    monkeypatch.setattr(trainer.Trainer, "_forward", nan_from_step_3)
    out = str(tmp_path / "run")
    with pytest.raises(NonFiniteLoss) as err:
        run(tiny, out, schedule__steps=30, checkpoint__every=1)
    step = int(str(err.value).split("at step ")[1].split(" ")[0])
    assert step == 4, "self.step counts the steps done: the forward of the 4th sees step 3"
    last_good = os.path.join(out, "checkpoints", f"step{step - 1:08d}")
    assert f"the last good checkpoint is {last_good}" in str(err.value)
    assert checkpoint_tags(os.path.join(out, "checkpoints"))[-1] == f"step{step - 1:08d}"
    assert not os.path.exists(os.path.join(out, "export"))


def test_two_ranks_agree_with_one_rank_and_zero_1_2_3_agree(tiny, tmp_path):
    """One launch of 2 ranks trains with ZeRO-1, -2 and -3 (parameters really partitioned: no persistence
    threshold); each must match 1 rank with 2 micro-batches, the same global batch."""
    ds3 = json.loads(open(os.path.join(REPO, "configs", "ds_zero3.json")).read())
    ds3["zero_optimization"].update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0)
    (tmp_path / "ds_zero3_partitioned.json").write_text(json.dumps(ds3))
    ds_files = [
        os.path.join(REPO, "configs", "ds_zero1.json"),
        os.path.join(REPO, "configs", "ds_zero2.json"),
        str(tmp_path / "ds_zero3_partitioned.json"),
    ]
    common = dict(schedule__steps=3, data__val_fraction=0.1)

    one = str(tmp_path / "one_rank")
    run(tiny, one, schedule__grad_accum=2, **common)

    # The in-process runs made this process a world of one; the launcher's ranks get their own variables.
    env = launch_env()
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [
        launcher,
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        os.path.join(REPO, "tests", "test_trainer_launch.py"),
        str(tmp_path / "two"),
        ",".join(ds_files),
        TINY_YAML,
        *settings(tiny, "unused", **common),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    reference, reference_weights = losses(one), exported(one)
    first_step = []
    for i, stage in enumerate((1, 2, 3)):
        out = str(tmp_path / "two" / f"run{i}")
        got = losses(out)
        assert got.keys() == reference.keys()
        for step, loss in reference.items():
            assert got[step] == pytest.approx(loss, rel=1e-5), f"ZeRO-{stage}, step {step}"
        first_step.append(got[1])
        assert records(out, "val")[0]["loss"] == pytest.approx(records(one, "val")[0]["loss"], rel=1e-5)
        weights = exported(out)
        for name, w in reference_weights.items():
            torch.testing.assert_close(weights[name], w, rtol=1e-4, atol=1e-5, msg=f"ZeRO-{stage} {name}")
    assert max(first_step) - min(first_step) < 1e-6, f"first-step losses of ZeRO-1/2/3 differ: {first_step}"
    drafter, _ = load_drafter_for_export(str(tmp_path / "two" / "run2"))  # fp32 master weights from both partitions
    weights = exported(str(tmp_path / "two" / "run2"))  # 16-bit path: gathered module weights
    for name, p in drafter.named_parameters():
        assert torch.equal(p, weights[name]), name
