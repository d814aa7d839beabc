"""Weights that may not be written (a NaN in the weights rank 0 gathers) in a run of 2 ranks: every rank stops with
the same one `error:` line, none waits at a barrier for the rank that found it: at a checkpoint
(checkpoint.save_checkpoint) and at the export (Trainer.export)."""
import os
import subprocess
import sys

import pytest
from launch_env import launch_env
from test_trainer import REPO, TINY_YAML, settings, tiny  # noqa: F401 (tiny: the module's fixture)

from dflash_fast.train.distributed import free_port


@pytest.mark.parametrize("where, overrides, message", [
    ("save", dict(export=False), "the checkpoint of step 1 was not saved: "),
    ("export", dict(export=True, export_dtype="fp32"), "export"),
])
def test_nan_weights_stop_every_rank_with_the_same_error_line(tiny, tmp_path, where, overrides, message):  # noqa: F811
    env = launch_env()
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "run"
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2", "--master_port",
           str(free_port()), os.path.join(REPO, "tests", "test_save_nan_launch.py"), where, "--config", TINY_YAML,
           *settings(tiny, str(out), schedule__steps=1, **overrides)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    # The ranks write their lines at the same moment: one may land inside the other's line.
    errors = [part.splitlines()[0] for part in text.split("error: ")[1:]]
    assert proc.returncode != 0 and len(errors) == 2, text[-4000:]
    assert errors[0] == errors[1] and message in errors[0], errors
    assert "fc.weight holds non-finite values" in text and "Traceback" not in text, text[-4000:]
    if where == "save":
        assert not os.path.exists(out / "checkpoints" / "step00000001"), "nothing of a refused checkpoint is written"
    else:
        assert not os.path.exists(out / "export")
