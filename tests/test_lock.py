"""One writer an output directory: a second extraction or training run into it refuses at once, naming the holder;
a lock left by a killed run is taken over with a message."""
import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from dflash_fast import cli
from dflash_fast.errors import UserError
from dflash_fast.lock import lock_path, output_lock

HOLD = "from dflash_fast.lock import output_lock\nwith output_lock({dir!r}):\n    print('held', flush=True)\n" \
       "    import time; time.sleep(600)\n"


@pytest.fixture
def holder(tmp_path):
    """Another process holding the lock of tmp_path/out -> its Popen (killed at the end)."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", HOLD.format(dir=str(out)), "--holder-flag"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait()


def test_a_second_writer_of_a_directory_is_refused_naming_the_holder(tmp_path, holder):
    with pytest.raises(UserError) as e:
        with output_lock(str(tmp_path / "out")):
            pass
    message = str(e.value)
    assert f"{tmp_path / 'out'} is in use by another dflash-fast run (pid {holder.pid} on {socket.gethostname()}, " \
           f"started " in message
    assert "-c --holder-flag" in message  # its command line


def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_message(tmp_path, holder):
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert os.path.exists(lock_path(str(tmp_path / "out")))  # a killed run cannot remove it
    said = []
    with output_lock(str(tmp_path / "out"), log=said.append):
        pass
    (message,) = said
    assert f"taking over the lock of pid {holder.pid} on {socket.gethostname()}" in message and "gone" in message
    assert not os.path.exists(lock_path(str(tmp_path / "out")))
    with output_lock(str(tmp_path / "out"), log=said.append):  # a normal exit leaves nothing to take over
        pass
    assert len(said) == 1


def test_ranks_of_one_job_lock_their_own_files(tmp_path):
    with output_lock(str(tmp_path), rank=0), output_lock(str(tmp_path), rank=1):
        with pytest.raises(UserError, match="in use by another dflash-fast run"):
            with output_lock(str(tmp_path), rank=1):
                pass


def test_an_extraction_into_a_locked_out_is_one_error_and_writes_nothing(tmp_path, holder, capsys):
    from tiny_targets import make_tiny_target, write_jsonl

    target = make_tiny_target(tmp_path / "target", "qwen3", num_layers=4, hidden_size=32)
    data = write_jsonl(tmp_path / "data.jsonl", [{"text": "one two three four five six"}] * 4)
    capsys.readouterr()
    code = cli.main(["extract", "--target", str(target), "--data", str(data), "--out", str(tmp_path / "out"),
                     "--layer-ids", "1,2"])
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'out'} is in use by another dflash-fast run (pid {holder.pid}")
    assert os.listdir(tmp_path / "out") == [os.path.basename(lock_path(str(tmp_path / "out")))]


def test_a_training_run_into_a_locked_output_dir_is_refused(tmp_path, holder, monkeypatch):
    from dflash_fast.train import trainer
    from dflash_fast.train.config import load_config

    monkeypatch.setattr(trainer, "init_distributed", lambda: (0, 1))  # a world of one, without DeepSpeed's start-up
    with pytest.raises(UserError, match=f"in use by another dflash-fast run \\(pid {holder.pid}"):
        trainer.train(load_config(None, [f"output_dir={tmp_path / 'out'}", "data.store=/nonexistent"]))


def test_a_taken_over_lock_holds_only_the_new_record_not_the_stale_tail(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    stale = {"pid": 1, "host": "elsewhere", "command": "train.py " + "x" * 2000, "started": "long ago"}
    with open(lock_path(str(out)), "w") as f:  # no process holds its flock: stale, and longer than our record
        json.dump(stale, f)
    said = []
    with output_lock(str(out), log=said.append) as path:
        with open(path) as f:
            record = json.load(f)  # the old tail left after the new record would make this unreadable JSON
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    assert "taking over the lock of pid 1 on elsewhere" in said[0]


def test_a_training_run_that_cannot_start_creates_no_output_dir(tmp_path, monkeypatch):
    from dflash_fast.train import trainer
    from dflash_fast.train.config import load_config

    monkeypatch.setattr(trainer, "init_distributed", lambda: (0, 1))  # a world of one, without DeepSpeed's start-up
    out = tmp_path / "runs" / "new" / "out"
    with pytest.raises(OSError, match="/nonexistent"):  # main() prints it as one `error:` line, exit 1
        trainer.train(load_config(None, [f"output_dir={out}", "data.store=/nonexistent"]))
    assert os.listdir(tmp_path) == []  # not out, nor the parents the lock made for it


def test_a_failed_run_keeps_an_output_dir_that_existed_or_was_written(tmp_path):
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(RuntimeError):
        with output_lock(str(existing)):
            raise RuntimeError("the run failed")
    written = tmp_path / "written"
    with pytest.raises(RuntimeError):
        with output_lock(str(written)):
            (written / "metrics.jsonl").write_text("{}\n")
            raise RuntimeError("the run failed")
    assert os.listdir(existing) == [] and os.listdir(written) == ["metrics.jsonl"]
