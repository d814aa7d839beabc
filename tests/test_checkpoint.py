"""Trainer checkpoints that someone else made or the disk damaged: export, eval and resume never run a pickle
they did not write, never trust bytes that changed after the save, and fall back to the newest checkpoint that
verifies, saying so (dflash_fast/train/checkpoint.py)."""
import glob
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from launch_env import launch_env
from safetensors.torch import load_file
from test_trainer import (
    REPO,
    TINY_YAML,
    exported,
    free_port,
    losses,
    run,
    settings,
    tiny,  # noqa: F401 (the fixture: parameters below redefine it, F811)
)
from tiny_targets import write_jsonl

from dflash_fast import cli
from dflash_fast.train import trainer
from dflash_fast.train.checkpoint import (
    MARKER,
    MARKER_FORMAT,
    WEIGHTS,
    CheckpointError,
    load_drafter_for_export,
    read_marker,
    rng_state,
    set_rng_state,
    verify_checkpoint,
)
from dflash_fast.train.config import ConfigError, load_config
from dflash_fast.train.distributed import init_distributed
from dflash_fast.train.trainer import NonFiniteLoss

STEPS = dict(schedule__steps=3, checkpoint__every=1, checkpoint__keep_last=3)


@pytest.fixture(scope="module")
def base(tiny, tmp_path_factory):  # noqa: F811
    """A finished 3-step run with a checkpoint after every step; tests damage copies of it."""
    out = str(tmp_path_factory.mktemp("base") / "run")
    run(tiny, out, **STEPS)
    return out


def copy_run(base, tmp_path):
    out = str(tmp_path / "run")
    shutil.copytree(base, out)
    return out


def ckpt(out, step):
    return os.path.join(out, "checkpoints", f"step{step:08d}")


class Payload:
    """Unpickling this creates the file `flag`: the harmless stand-in for code a crafted checkpoint would run."""

    def __init__(self, flag):
        self.flag = str(flag)

    def __reduce__(self):
        return open, (self.flag, "w")


def plant(path, flag):
    torch.save(Payload(flag), path)
    probe = str(path) + ".probe"
    shutil.copy(path, probe)
    torch.load(probe, weights_only=False)  # the payload is live: unpickling it does create the flag
    assert os.path.exists(flag)
    os.remove(flag)
    os.remove(probe)


def resign(checkpoint):
    """Forge the completion marker over the files as they are now (when the marker lists files), as someone who
    hands out a crafted checkpoint would: checksums then prove nothing, so what the readers read must be safe."""
    path = os.path.join(checkpoint, MARKER)
    marker = json.loads(open(path).read())
    if "files" in marker:
        marker["files"] = {
            name: {"size": os.path.getsize(os.path.join(checkpoint, name)),
                   "sha256": hashlib.sha256(open(os.path.join(checkpoint, name), "rb").read()).hexdigest()}
            for name in os.listdir(checkpoint)
            if name != MARKER
        }
        open(path, "w").write(json.dumps(marker))


def zero_bytes(path):
    """Same size, 64 bytes in the middle zeroed: damage that no size check sees."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        assert f.read(64) != bytes(64)
        f.seek(size // 2)
        f.write(bytes(64))


def optimizer_states(checkpoint):
    (path,) = glob.glob(os.path.join(checkpoint, "*optim_states.pt"))
    return path


# ---------------------------------------------------------------- the format


def test_a_checkpoint_holds_safetensors_weights_json_rng_and_a_marker_with_every_files_sha256(base):
    step3 = ckpt(base, 3)
    marker = json.loads(open(os.path.join(step3, MARKER)).read())
    on_disk = sorted(n for n in os.listdir(step3) if n != MARKER)
    assert sorted(marker["files"]) == on_disk and WEIGHTS in on_disk and "rng_rank00000.json" in on_disk
    for name, recorded in marker["files"].items():
        data = open(os.path.join(step3, name), "rb").read()
        assert recorded == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    assert marker["client"]["step"] == 3 and verify_checkpoint(step3) == []
    json.loads(open(os.path.join(step3, "rng_rank00000.json")).read())  # the RNG state is JSON, not a pickle
    drafter, _ = load_drafter_for_export(base)
    weights, final = load_file(os.path.join(step3, WEIGHTS)), exported(base)
    for name, p in drafter.named_parameters():
        assert weights[name].dtype == torch.float32 and torch.equal(p, weights[name]) and torch.equal(p, final[name])


def test_rng_state_round_trips_through_json():
    random.gauss(0, 1), np.random.standard_normal(), torch.randn(3)  # leave cached Gaussians in Python and numpy
    state = json.loads(json.dumps(rng_state()))
    first = (random.random(), random.gauss(0, 1), np.random.standard_normal(2).tolist(), torch.rand(4))
    set_rng_state(state)
    again = (random.random(), random.gauss(0, 1), np.random.standard_normal(2).tolist(), torch.rand(4))
    assert first[:3] == again[:3] and torch.equal(first[3], again[3])


# ---------------------------------------------------------------- no code execution


def test_export_and_eval_of_a_crafted_checkpoint_never_unpickle_it(tiny, base, tmp_path):  # noqa: F811
    out = copy_run(base, tmp_path)
    flag = tmp_path / "payload_ran"
    for path in glob.glob(os.path.join(ckpt(out, 3), "*.pt")):  # every DeepSpeed file, and a pickled RNG state
        plant(path, flag)
    plant(os.path.join(ckpt(out, 3), "rng_rank00000.pt"), flag)
    resign(ckpt(out, 3))
    assert cli.main(["export", "--checkpoint", ckpt(out, 3), "--out", str(tmp_path / "export"), "--dtype", "fp32"]) == 0
    assert not flag.exists(), "export unpickled a file of the checkpoint"
    written, trained = load_file(str(tmp_path / "export" / "model.safetensors")), exported(base)
    assert written.keys() == trained.keys() and all(torch.equal(written[k], trained[k]) for k in written)

    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"text": "the drafter reads"}])
    report = tmp_path / "report.json"
    argv = ["eval", "--target", tiny.target, "--drafter", ckpt(out, 3), "--data", str(prompts), "--max-new-tokens",
            "4", "--no-baseline", "--no-offline", "--out", str(report)]
    assert cli.main(argv) == 0 and json.loads(report.read_text())["prompts"] == 1
    assert not flag.exists(), "eval unpickled a file of the checkpoint"


def test_resume_refuses_files_swapped_in_after_the_save_and_continues_exactly_from_the_last_that_verifies(
    tiny, base, tmp_path, capsys  # noqa: F811
):
    out = copy_run(base, tmp_path)
    flag = tmp_path / "payload_ran"
    plant(os.path.join(ckpt(out, 3), "mp_rank_00_model_states.pt"), flag)  # DeepSpeed's loader would run it
    plant(os.path.join(ckpt(out, 3), "rng_rank00000.pt"), flag)
    resumed = run(tiny, out, checkpoint__resume="latest", **STEPS)
    assert not flag.exists(), "resume unpickled a file that its run's checksums do not cover"
    log = capsys.readouterr().out
    assert f"using {ckpt(out, 2)}, the newest checkpoint that verifies" in log
    assert "mp_rank_00_model_states.pt: " in log and "bytes, the marker records" in log
    assert "rng_rank00000.pt: not listed in the marker" in log
    assert resumed["step"] == 3 and losses(out) == losses(base), "resuming from step 2 must retrain step 3 exactly"
    a, b = exported(out), exported(base)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert os.path.isdir(ckpt(out, 3) + ".superseded") and verify_checkpoint(ckpt(out, 3)) == []


@pytest.mark.parametrize("victim", ["mp_rank_00_model_states.pt", "optimizer states"])
def test_resume_loads_deepspeeds_files_weights_only_and_refuses_a_pickle_even_under_a_forged_marker(
    tiny, base, tmp_path, victim  # noqa: F811
):
    out = copy_run(base, tmp_path)
    flag = tmp_path / "payload_ran"
    path = optimizer_states(ckpt(out, 3)) if victim == "optimizer states" else os.path.join(ckpt(out, 3), victim)
    plant(path, flag)
    resign(ckpt(out, 3))  # the checksums now vouch for the payload: only the loader can refuse it
    with pytest.raises(CheckpointError, match=rf"{os.path.basename(path)}: holds a pickled object that is not "
                                              rf"training state \(\S*open\); resume loads DeepSpeed's files "
                                              rf"weights-only"):
        run(tiny, out, checkpoint__resume="latest", **STEPS)
    assert not flag.exists(), "resume ran code from a DeepSpeed file"


# ---------------------------------------------------------------- silent corruption


def test_bytes_zeroed_inside_a_checkpoint_are_refused_by_name_and_skipped_when_a_run_is_read(
    tiny, base, tmp_path, capsys  # noqa: F811
):
    out = copy_run(base, tmp_path)
    damaged = optimizer_states(ckpt(out, 3))
    zero_bytes(damaged)
    with pytest.raises(ConfigError, match=rf"{os.path.basename(damaged)}: sha256 .*same size"):
        run(tiny, out, checkpoint__resume=ckpt(out, 3), **STEPS)
    assert cli.main(["export", "--checkpoint", ckpt(out, 3), "--out", str(tmp_path / "e3")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: the checkpoint {ckpt(out, 3)} does not verify: ") and err.count("\n") == 1
    zero_bytes(os.path.join(ckpt(out, 2), WEIGHTS))
    assert cli.main(["export", "--checkpoint", out, "--out", str(tmp_path / "e1"), "--dtype", "fp32"]) == 0
    err = capsys.readouterr().err
    assert f"using {ckpt(out, 1)}, the newest checkpoint that verifies" in err
    assert f"step00000003: {os.path.basename(damaged)}: sha256" in err and f"step00000002: {WEIGHTS}: sha256" in err
    step1 = load_file(os.path.join(ckpt(base, 1), WEIGHTS))
    written = load_file(str(tmp_path / "e1" / "model.safetensors"))
    assert all(torch.equal(written[k], step1[k]) for k in step1)


def test_a_torn_save_or_an_empty_or_corrupt_marker_is_an_incomplete_checkpoint(
    tiny, base, tmp_path, capsys  # noqa: F811
):
    out = copy_run(base, tmp_path)
    os.remove(os.path.join(ckpt(out, 3), MARKER))  # killed before the marker was written
    open(os.path.join(ckpt(out, 3), "left_by_the_killed_save"), "w").close()
    open(os.path.join(ckpt(out, 2), MARKER), "w").close()  # empty
    resumed = run(tiny, out, checkpoint__resume="latest", **STEPS)
    log = capsys.readouterr().out
    assert f"using {ckpt(out, 1)}, the newest checkpoint that verifies" in log
    assert "step00000003: incomplete: no completion marker" in log
    assert f"step00000002: incomplete: its completion marker {MARKER} is unreadable" in log
    assert resumed["step"] == 3 and losses(out) == losses(base)
    assert verify_checkpoint(ckpt(out, 3)) == [] and verify_checkpoint(ckpt(out, 2)) == []
    assert not os.path.exists(os.path.join(ckpt(out, 3), "left_by_the_killed_save")), "the torn save's files stayed"


def test_a_marker_that_lists_files_outside_its_checkpoint_is_not_a_marker(tmp_path):
    checkpoint = tmp_path / "step00000001"
    checkpoint.mkdir()
    (checkpoint / "secret").write_text("x")
    digest = {"size": 1, "sha256": hashlib.sha256(b"x").hexdigest()}
    for name in ("../secret", "/etc/hostname"):
        marker = {"format": MARKER_FORMAT, "client": {}, "files": {name: digest}}
        (checkpoint / MARKER).write_text(json.dumps(marker))
        assert read_marker(str(checkpoint))[0] is None, name
    (checkpoint / MARKER).write_text(json.dumps({"format": MARKER_FORMAT, "client": {}, "files": {"secret": digest}}))
    assert read_marker(str(checkpoint))[0] is not None and verify_checkpoint(str(checkpoint)) == []


def test_a_non_finite_loss_calls_the_last_checkpoint_good_only_if_it_verifies(
    tiny, tmp_path, monkeypatch  # noqa: F811
):
    # A NaN in the store is dropped at load (tests/test_nonfinite.py): the loss turns NaN from step 3 on instead.
    real_forward, real_save = trainer.Trainer._forward, trainer.Trainer.save

    def nan_from_step_3(self, *args):
        out = real_forward(self, *args)
        return out._replace(loss=out.loss * float("nan")) if self.step >= 3 else out

    def save_then_damage(self):
        real_save(self)
        zero_bytes(optimizer_states(self.last_checkpoint))

    monkeypatch.setattr(trainer.Trainer, "save", save_then_damage)
    monkeypatch.setattr(trainer.Trainer, "_forward", nan_from_step_3)
    with pytest.raises(NonFiniteLoss) as err:
        run(tiny, str(tmp_path / "run"), schedule__steps=30, checkpoint__every=1)
    message = str(err.value)
    assert "good" not in message and "does not verify" in message and "optim_states.pt: sha256" in message


def test_two_ranks_verify_together_and_resume_exactly_past_a_file_only_rank_1_hashed(tiny, tmp_path):  # noqa: F811
    env = launch_env()
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [launcher, "--num_gpus", "2", "--master_port", str(free_port()),
           os.path.join(REPO, "tests", "test_checkpoint_launch.py"), str(tmp_path), TINY_YAML,
           *settings(tiny, "unused", **STEPS)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert f"using {ckpt(b, 2)}, the newest checkpoint that verifies" in proc.stdout
    assert "step00000003: zero_pp_rank_1_mp_rank_00_optim_states.pt: sha256" in proc.stdout
    assert losses(b) == losses(a) and os.path.isdir(ckpt(b, 3) + ".superseded")
    assert verify_checkpoint(ckpt(b, 3)) == [] and len(glob.glob(os.path.join(ckpt(b, 3), "rng_rank*.json"))) == 2


# ---------------------------------------------------------------- compatibility


def pre_split_run(tmp_path):
    """A copy of tests/fixtures/pre_split_run -> (its run directory, the overrides that continue it to step 3)."""
    root = tmp_path / "pre_split_run"
    shutil.copytree(os.path.join(REPO, "tests", "fixtures", "pre_split_run"), root)
    out = root / "run"
    return out, [f"model.target={root / 'target'}", f"data.store={root / 'store'}", f"output_dir={out}",
                 f"deepspeed={os.path.join(REPO, 'configs', 'ds_zero1.json')}", "precision=fp32", "kernels=eager",
                 "schedule.steps=3"]


def test_a_run_checkpointed_before_the_trainer_split_resumes_where_it_stopped(tmp_path):
    """A run directory written by the trainer before its split into data / model / optim / metrics / distributed
    / checkpoint (commit e4eac10) resumes under today's code: the weights, AdamW's moments, the schedule's position
    and the data position all come back, and the run goes on from step 2 to step 3.

    Why a committed fixture (tests/fixtures/pre_split_run, ~200 KB; tests/fixtures/make_pre_split_run.py says
    how it was made): the pre-split trainer cannot be imported any more, and a target or store rebuilt here would
    not be the bytes that run recorded (the tiny tokenizer learns from the stdlib's source, which changes between
    Python versions, and config.json records the transformers version), so the fixture holds its target, its
    store and the run: config.yaml, metrics.jsonl and the checkpoint of its last step."""
    out, overrides = pre_split_run(tmp_path)
    cfg = load_config(str(out / "config.yaml"), overrides + ["checkpoint.resume=latest"])
    t = trainer.Trainer(cfg, *init_distributed())
    assert t.step == 2 and t.stream.position == (0, 2)
    saved = load_file(os.path.join(ckpt(str(out), 2), WEIGHTS))
    for name, p in t.engine.module.named_parameters():
        if p.requires_grad:
            assert torch.equal(p.detach(), saved[name]), f"{name}: not the checkpoint's weights"
    moments = list(t.engine.basic_optimizer.state.values())
    assert moments and all(int(s["step"]) == 2 and s["exp_avg"].abs().sum() > 0 for s in moments)
    assert t.engine.lr_scheduler.last_epoch == 2  # the schedule resumed at update 2, it did not restart at 0
    assert t.run() == {"step": 3, "interrupted": False, "checkpoint": ckpt(str(out), 3), "export": None}
    with open(out / "metrics.jsonl") as f:
        assert [r["step"] for r in map(json.loads, f)] == [1, 2, 3]


def test_resume_drops_a_torn_last_metrics_line_and_says_so(tmp_path, capsys):
    """A run killed mid-write (kill -9) leaves a torn last line in metrics.jsonl: --resume drops it, naming the file
    in one line on stderr, and goes on (it stopped on a JSON error that named no file)."""
    out, overrides = pre_split_run(tmp_path)
    metrics = out / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"split": "train", "step": 3, "lo')
    trainer.main(["--config", str(out / "config.yaml"), "--resume", *overrides])
    err = [line for line in capsys.readouterr().err.splitlines() if "metrics.jsonl" in line]
    assert err == [f"{metrics}: dropped its torn last line 3 (the run stopped while writing it): "
                   f"'{{\"split\": \"train\", \"step\": 3, \"lo'"]
    with open(metrics) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3]
