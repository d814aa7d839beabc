"""The process group a training job runs in, and what each rank computes in.

Without a launcher (`python train.py ...`) the job is a world of one process; under `deepspeed` (or `torchrun`)
every rank runs it. The group lives as long as the process: several runs in one process (the tests) share it.
"""
import os
import socket
import sys
import warnings
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from dflash_fast.train.build_lock import check_build_locks
from dflash_fast.train.checkpoint import Sharing


def free_port() -> int:
    """A TCP port free on this host now (for a one-process world or a launcher's --master_port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> Tuple[int, int]:
    """torch.distributed through DeepSpeed for the launcher's ranks, or a world of one when no launcher
    set RANK -> (rank, world size). The group lives as long as the process (DeepSpeed caches groups
    made from it), so several runs in one process share it.

    Every call first refuses a stale JIT build lock (build_lock.py): DeepSpeed's start-up and the engine a run
    builds next (cpu_adam) load their ops through it, and would wait on it forever; train.py and in-process
    callers (the tests) alike come through here."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    first = os.environ.get("RANK", "0") == "0"
    check_build_locks(say=lambda line: print(f"[dflash-fast] {line}", file=sys.stderr) if first else None)
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(
                RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
            )
        if torch.cuda.is_available():
            get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", 0)))
        deepspeed.init_distributed(auto_mpi_discovery=False, verbose=False)
        unlink_shm_buffer()
    return dist.get_rank(), dist.get_world_size()


def shm_buffer_path(rank: int) -> str:
    """The shared-memory file DeepSpeed's CPU all-reduce (ops/csrc/cpu/comm/shm.cpp, shm_initialize) creates for
    `rank` when every rank is on this host (LOCAL_SIZE == WORLD_SIZE): 'deepspeed_allreduce_buffer_' + uid,
    MASTER_ADDR, MASTER_PORT and the rank joined by '_', about 69 MB."""
    parts = (os.getuid(), os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""), rank)
    return os.path.join("/dev/shm", "deepspeed_allreduce_buffer_" + "_".join(map(str, parts)))


def unlink_shm_buffer() -> None:
    """Remove this rank's DeepSpeed all-reduce buffer from /dev/shm once every rank has mapped it. DeepSpeed never
    unlinks it (shared_close is never called), so each run left one 69 MB file per rank behind, filling /dev/shm.
    Each rank maps every rank's buffer inside init_distributed; after the barrier the mappings live on until the
    process exits and the name is no longer needed, so no exit (an error, SIGTERM, even SIGKILL) leaves it.
    Only this rank's own file: another job's (another port) is never touched."""
    path = shm_buffer_path(dist.get_rank())
    dist.barrier()  # every rank has opened every other rank's buffer
    try:
        os.unlink(path)
    except FileNotFoundError:  # not every rank on this host (no shm all-reduce), or a world of one
        pass


def quiet_deepspeed() -> None:
    import logging

    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+`? is deprecated", category=FutureWarning)


def sharing(rank: int, world_size: int) -> Sharing:
    """How this job's ranks share a checkpoint's work: the sha256s, its collectives (every rank calls what takes
    it)."""

    def gather(obj):
        out = [None] * world_size
        dist.all_gather_object(out, obj)
        return out

    return Sharing(rank, world_size, gather, dist.barrier)


def resolve_precision(precision: str) -> Tuple[str, torch.dtype]:
    """precision (auto: bf16 where the GPU has it, else fp32) -> (name, compute dtype)."""
    if precision == "auto":
        precision = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
    return precision, torch.bfloat16 if precision == "bf16" else torch.float32


def gathered_state(module: torch.nn.Module, rank: int, zero_stage: int) -> Optional[Dict[str, torch.Tensor]]:
    """Every parameter of `module` as a CPU copy in its module dtype, gathered from every ZeRO-3 partition: rank 0
    gets them, the others None. A collective: every rank calls it."""
    import deepspeed

    params = dict(module.named_parameters())
    state = None
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None, enabled=zero_stage == 3):
        if rank == 0:
            state = {name: p.detach().to("cpu", copy=True) for name, p in params.items()}
    return state
