"""Run by test_rank0_failure.py under the deepspeed launcher: `train.py` (trainer.main, each rank's errors reported
as one line) with a disk error in what rank 0 alone writes: the checkpoint's weights (`weights`), the checkpoint's
completion marker (`marker`), or a record of OUT/metrics.jsonl (`metrics`).

    deepspeed --num_gpus 2 tests/test_rank0_failure_launch.py weights|marker|metrics --config CONFIG.yaml [k=v ...]

Holds no tests itself.
"""
import errno
import sys

from dflash_fast.train import checkpoint, metrics, trainer


def disk_full(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, "No space left on device (injected)", "the file rank 0 writes")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher's; LOCAL_RANK is set
    if args[0] == "weights":
        checkpoint.write_weights = disk_full  # called on rank 0 only
    elif args[0] == "marker":
        written = checkpoint.write_json_atomic  # the RNG files (every rank) are written; the marker (rank 0) fails
        checkpoint.write_json_atomic = lambda path, obj: disk_full() if path.endswith(checkpoint.MARKER) \
            else written(path, obj)
    else:
        metrics.MetricsLog.record = lambda self, _entry: disk_full() if self.writer else None
    trainer.main(args[1:])
