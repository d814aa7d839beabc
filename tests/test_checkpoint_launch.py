"""Run by test_checkpoint.py under the deepspeed launcher: train with a checkpoint after every step into OUT/a,
copy it to OUT/b, zero bytes in the last rank's optimizer states of b's newest checkpoint (a file that rank,
not rank 0, hashes when verifying) and resume b from `latest`.

    deepspeed --num_gpus 2 tests/test_checkpoint_launch.py OUT CONFIG.yaml [key=value ...]

Holds no tests itself.
"""
import glob
import os
import shutil
import sys

import torch.distributed as dist

from dflash_fast.train.config import load_config
from dflash_fast.train.trainer import train


def run(argv):
    args = [a for a in argv if not a.startswith("--local_rank")]  # the launcher's; LOCAL_RANK is in the environment
    out, config, overrides = args[0], args[1], args[2:]
    train(load_config(config, [*overrides, f"output_dir={os.path.join(out, 'a')}"]))
    dist.barrier()  # every rank has released its output lock (removed its lock file) before rank 0 copies OUT/a
    if dist.get_rank() == 0:
        shutil.copytree(os.path.join(out, "a"), os.path.join(out, "b"))
        last_rank = dist.get_world_size() - 1
        (last,) = glob.glob(os.path.join(out, "b", "checkpoints", "step*3", f"*rank_{last_rank}_*optim*"))
        with open(last, "r+b") as f:
            f.seek(os.path.getsize(last) // 2)
            f.write(bytes(64))
    dist.barrier()
    train(load_config(config, [*overrides, f"output_dir={os.path.join(out, 'b')}", "checkpoint.resume=latest"]))
    # as train.py does (trainer.main): a group left to interpreter exit aborted a rank there once in a clean-clone run
    # ("terminate called without an active exception", return code -6, after both trainings had finished)
    dist.destroy_process_group()


if __name__ == "__main__":
    run(sys.argv[1:])
