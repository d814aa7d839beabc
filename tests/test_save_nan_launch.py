"""Run by test_save_nan.py under the deepspeed launcher: `train.py` (trainer.main, each rank's errors reported as
one line) with a NaN in what rank 0 alone holds: the gathered master weights at every save (`save`), or the
gathered module weights the export writes (`export`).

    deepspeed --num_gpus 2 tests/test_save_nan_launch.py save|export --config CONFIG.yaml [key=value ...]

Holds no tests itself.
"""
import sys

from dflash_fast.train import checkpoint, trainer

gathered, exported = checkpoint.master_weights, trainer.export_run


def poison(weights):
    weights["fc.weight"][0, 0] = float("nan")


def poisoned_save(engine, rank):
    weights = gathered(engine, rank)
    if weights is not None:  # rank 0 alone holds the gathered weights, and alone can see the NaN
        poison(weights)
    return weights


def poisoned_export(*args, state_dict, **kwargs):  # called on rank 0 only
    poison(state_dict)
    return exported(*args, state_dict=state_dict, **kwargs)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher's; LOCAL_RANK is set
    if args[0] == "save":
        checkpoint.master_weights = poisoned_save
    else:
        trainer.export_run = poisoned_export
    trainer.main(args[1:])
