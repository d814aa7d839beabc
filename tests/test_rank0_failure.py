"""A failure in what rank 0 alone writes, other than the weight check and the export (test_save_nan.py): a disk
error writing the checkpoint's weights, its marker, or OUT/metrics.jsonl. In a run of 2 ranks every rank stops with
the same one `error:` line; none waits at a barrier (or the next step's all-reduce) for the rank that failed
(checkpoint.Sharing.on_every_rank / on_rank0)."""
import os
import subprocess
import sys

import pytest
from launch_env import launch_env
from test_trainer import REPO, TINY_YAML, settings, tiny  # noqa: F401 (tiny: the module's fixture)

from dflash_fast.train.distributed import free_port


@pytest.mark.parametrize("where, message", [
    ("weights", "the checkpoint of step 1 was not saved: [Errno 28] No space left on device (injected)"),
    ("marker", "the checkpoint of step 1 was not saved: [Errno 28] No space left on device (injected)"),
    ("metrics", "[Errno 28] No space left on device (injected)"),
])
def test_a_disk_error_on_rank0_stops_every_rank_with_the_same_error_line(tiny, tmp_path, where, message):  # noqa: F811
    env = launch_env(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2", "--master_port",
           str(free_port()), os.path.join(REPO, "tests", "test_rank0_failure_launch.py"), where, "--config", TINY_YAML,
           *settings(tiny, str(tmp_path / "run"), schedule__steps=2, checkpoint__every=1, logging__every=1,
                     export=False)]
    # Without the shared verdict rank 1 waits at the next barrier or all-reduce: the timeout fails the test.
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    text = proc.stdout + proc.stderr
    errors = [part.splitlines()[0] for part in text.split("error: ")[1:]]  # lines may interleave
    assert proc.returncode != 0 and len(errors) == 2, text[-4000:]
    assert errors[0] == errors[1] and message in errors[0], errors
    assert "Traceback" not in text, text[-4000:]
