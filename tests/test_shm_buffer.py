"""DeepSpeed's CPU all-reduce leaves a 69 MB /dev/shm/deepspeed_allreduce_buffer_* file per rank per run (its
shm.cpp never unlinks it); a run of 2 ranks on one host leaves none of its own behind, however it ends: a normal
exit, an exception, SIGTERM or SIGKILL (distributed.unlink_shm_buffer removes each rank's own file once every
rank has mapped it, at start-up: no exit path needs to run anything). Files of other jobs (another port) are left
alone."""
import glob
import os
import subprocess
import sys

import pytest
from launch_env import launch_env

from dflash_fast.train.distributed import free_port, shm_buffer_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_buffer_name_is_deepspeeds(monkeypatch):
    """The name shm.cpp's shm_initialize builds: SHM_BUFFER_NAME, uid, MASTER_ADDR, MASTER_PORT, rank."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29123")
    assert os.path.basename(shm_buffer_path(1)) == \
        f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_29123_1"


@pytest.mark.parametrize("how", ["ok", "error", "sigterm", "sigkill"])
def test_a_run_of_two_ranks_leaves_no_shm_buffer_of_its_own(how):
    port = free_port()
    other = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{free_port()}_0"
    with open(other, "wb") as f:  # another job's buffer: not ours to remove
        f.write(b"x")
    try:
        env = launch_env(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
        cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2", "--master_port",
               str(port), os.path.join(REPO, "tests", "test_shm_buffer_launch.py"), how]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        text = proc.stdout + proc.stderr
        assert (proc.returncode == 0) == (how == "ok"), text[-3000:]
        assert all(f"buffer {rank} seen /dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_{rank}"
                   in text for rank in (0, 1)), text[-3000:]  # DeepSpeed made them, under the name we remove
        left = glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*")
        assert left == [], left
        assert os.path.exists(other)
    finally:
        os.unlink(other)
