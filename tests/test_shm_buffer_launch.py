"""Run by test_shm_buffer.py under the deepspeed launcher: start the process group as a training run does
(distributed.init_distributed), then end the way the test asks: `ok` (a normal exit), `error` (an exception),
`sigterm` or `sigkill` (the signal, from outside the process's own handlers).

    deepspeed --num_gpus 2 tests/test_shm_buffer_launch.py ok|error|sigterm|sigkill

Prints `buffer RANK seen PATH` when DeepSpeed created this rank's buffer under the name distributed.shm_buffer_path
gives (checked just before the trainer removes it). Holds no tests itself.
"""
import os
import signal
import sys

from dflash_fast.train import distributed

unlink = distributed.unlink_shm_buffer


def seen_then_unlink():
    path = distributed.shm_buffer_path(int(os.environ["RANK"]))
    if os.path.exists(path):
        print(f"buffer {os.environ['RANK']} seen {path}", flush=True)
    unlink()


if __name__ == "__main__":
    how = [a for a in sys.argv[1:] if not a.startswith("--local_rank")][0]
    distributed.unlink_shm_buffer = seen_then_unlink
    distributed.init_distributed()
    if how == "error":
        raise RuntimeError("a failure after start-up")
    if how in ("sigterm", "sigkill"):
        os.kill(os.getpid(), getattr(signal, how.upper()))
