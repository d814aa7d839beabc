"""Run from anywhere: a config's `deepspeed` JSON is found beside the config, not in the current directory, and
the quickstart's training stage launches DeepSpeed without the venv on PATH."""
import os
import shutil
import subprocess

import pytest
from test_trainer import REPO, TINY_YAML, settings, tiny  # noqa: F401  (tiny: the fixture)

from dflash_fast.evaluate.quickstart import train_command
from dflash_fast.train.config import ConfigError, load_config


def test_a_configs_deepspeed_json_is_found_beside_it_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config(TINY_YAML).deepspeed == os.path.join(REPO, "configs", "ds_zero1.json")
    own = tmp_path / "mine"
    own.mkdir()
    shutil.copy(TINY_YAML, own / "run.yaml")
    shutil.copy(os.path.join(REPO, "configs", "ds_zero3.json"), own / "zero3.json")
    with open(own / "run.yaml", "a") as f:
        f.write("deepspeed: zero3.json\n")
    assert load_config(str(own / "run.yaml")).deepspeed == str(own / "zero3.json")
    # A command-line path is the user's: relative to where the command runs.
    assert load_config(str(own / "run.yaml"), ["deepspeed=mine/zero3.json"]).deepspeed == "mine/zero3.json"


def test_a_deepspeed_path_written_for_the_current_directory_is_refused_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    shutil.copy(os.path.join(REPO, "configs", "ds_zero1.json"), tmp_path / "configs" / "ds_zero1.json")
    (tmp_path / "configs" / "run.yaml").write_text("deepspeed: configs/ds_zero1.json\n")
    with pytest.raises(ConfigError, match=r"configs/run.yaml: deepspeed: configs/ds_zero1.json is .*configs/configs/"
                                          r"ds_zero1.json, which does not exist .*: write deepspeed: ds_zero1.json"):
        load_config("configs/run.yaml")


def test_training_runs_from_another_directory_with_no_deepspeed_on_path(tiny, tmp_path, monkeypatch):  # noqa: F811
    """The quickstart's training stage (train_command) with tiny.yaml's own DeepSpeed JSON, launched from a
    directory that is not the checkout, under a PATH that holds no venv (and so no `deepspeed` script)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "run"
    overrides = [o for o in settings(tiny, str(out), schedule__steps=2) if not o.startswith("deepspeed=")]
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # the quickstart run as /path/to/venv/bin/dflash-fast
    cmd = train_command(TINY_YAML, overrides)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert os.path.exists(out / "export" / "model.safetensors")
    assert os.listdir(elsewhere) == []
