"""A JIT build lock left by a killed run (the torch-extensions cache's `<op>/lock`) stops a training run before
DeepSpeed starts, in one line naming the file, instead of a start-up that waits forever without a word; a lock
a live build holds is left alone. Fake caches only (TORCH_EXTENSIONS_DIR): nothing is built here."""
import os
import subprocess
import sys
import time

import pytest

from dflash_fast.errors import UserError
from dflash_fast.train.build_lock import STALE_AFTER_S, check_build_locks, extensions_root

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fake_lock(root, op="deepspeed_shm_comm", age_s=2 * STALE_AFTER_S):
    """`root/op/lock`, its mtime `age_s` seconds ago (what a build killed that long ago leaves)."""
    lock = root / op / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_the_extensions_root_is_torch_extensions_dir_when_set(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert extensions_root() == str(tmp_path)


def test_an_old_lock_no_process_builds_under_is_refused_naming_the_file(tmp_path):
    lock = fake_lock(tmp_path)
    (tmp_path / "cpu_adam").mkdir()  # an op built cleanly: no lock, nothing to say
    with pytest.raises(UserError, match=f"stale JIT build lock .*{lock} .*rm {lock}"):
        check_build_locks(str(tmp_path))


def test_a_lock_a_live_build_holds_is_left_alone(tmp_path):
    lock = fake_lock(tmp_path)
    said = []
    with subprocess.Popen(["sleep", "30"], cwd=lock.parent) as build:  # ninja runs in the op's directory
        try:
            check_build_locks(str(tmp_path), said.append)
        finally:
            build.kill()
    assert said == []


def test_a_young_lock_is_waited_on_but_said(tmp_path):
    lock = fake_lock(tmp_path, age_s=5)
    said = []
    check_build_locks(str(tmp_path), said.append)
    assert len(said) == 1 and str(lock) in said[0] and "remove it" in said[0]


def test_train_py_over_a_stale_lock_ends_in_one_error_line_before_deepspeed_starts(tmp_path):
    """DeepSpeed's CPU start-up loads deepspeed_shm_comm through this lock: without the check the run waits on it
    forever (the timeout below fails the test)."""
    lock = fake_lock(tmp_path / "extensions")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "extensions")
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "train.py"), "--config", os.path.join(REPO, "configs", "tiny.yaml"),
         f"data.store={tmp_path / 'store'}", f"output_dir={tmp_path / 'out'}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180,
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1 and f"rm {lock}" in errors[0], proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_an_in_process_run_checks_the_locks_too(tmp_path, monkeypatch):
    """Tests build Trainers in the pytest process through distributed.init_distributed, with the process group
    already up from an earlier test; the engine they build next loads its ops (cpu_adam) through the same lock.
    init_distributed checks on every call, not only the first."""
    from dflash_fast.train.distributed import init_distributed

    init_distributed()  # the group, as an earlier test leaves it
    lock = fake_lock(tmp_path, op="cpu_adam")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    with pytest.raises(UserError, match=f"stale JIT build lock .*rm {lock}"):
        init_distributed()
