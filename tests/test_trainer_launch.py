"""Run by test_trainer.py under the deepspeed launcher: one training per DeepSpeed JSON in ONE launch
(a launch costs tens of seconds of start-up on a small CPU, a tiny training a few).

    deepspeed --num_gpus 2 tests/test_trainer_launch.py OUT_ROOT A.json,B.json,... CONFIG.yaml [key=value ...]

Run i writes OUT_ROOT/run<i>. Holds no tests itself.
"""
import os
import sys

import torch.distributed as dist

from dflash_fast.train.config import load_config
from dflash_fast.train.trainer import train


def run_each(argv):
    args = [a for a in argv if not a.startswith("--local_rank")]  # the launcher's; LOCAL_RANK is in the environment
    out_root, ds_configs, config, overrides = args[0], args[1].split(","), args[2], args[3:]
    for i, ds in enumerate(ds_configs):
        train(load_config(config, [*overrides, f"deepspeed={ds}", f"output_dir={os.path.join(out_root, f'run{i}')}"]))
    if dist.is_initialized():  # as train.py does (trainer.main), not left to interpreter exit (test_checkpoint_launch)
        dist.destroy_process_group()


if __name__ == "__main__":
    run_each(sys.argv[1:])
