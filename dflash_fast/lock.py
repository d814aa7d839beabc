"""One writer an output directory: extraction (`--out`) and training (`output_dir`) hold a lock on it while they
write, so a second run into the same directory refuses at once, naming the holder, instead of failing half-way
with an errno and a torn `.tmp` shard.

    DIR/.dflash-fast-rankNNNNN.lock    {"pid", "host", "command", "started"} of the run that holds it

Each rank of a job locks its own file (ranks of one job write different files; two jobs collide on rank 0 at
least). The lock is an `flock` on that file, so the kernel releases it when its holder dies however it dies; a
file left by a killed run is taken over, with a message naming the run that left it. A normal exit removes it; a
run that fails removes the directories the lock created if they are still empty (a run that cannot start, e.g. on a
missing store, leaves nothing behind).
"""
import fcntl
import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from typing import Iterator, List, Optional

from dflash_fast.errors import INT, STR, Obj, UserError, schema_problem

HOLDER = Obj({"pid": INT, "host": STR, "command": STR, "started": STR})


def lock_path(directory: str, rank: int = 0) -> str:
    return os.path.join(directory, f".dflash-fast-rank{rank:05d}.lock")


def _holder(fd: int) -> Optional[dict]:
    """The holder recorded in the open lock file, or None (empty: its holder is starting; or not ours)."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"null")
    except (ValueError, RecursionError):
        return None
    return holder if schema_problem(holder, HOLDER) is None else None


def _describe(holder: Optional[dict]) -> str:
    if holder is None:
        return "a run that has not recorded itself yet"
    return f"pid {holder['pid']} on {holder['host']}, started {holder['started']}: {holder['command']}"


def _make_missing(directory: str) -> List[str]:
    """Create `directory` and its missing parents -> the ones this call created, deepest first."""
    missing, path = [], os.path.abspath(directory)
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    created = []
    for path in reversed(missing):
        try:
            os.mkdir(path)
            created.append(path)
        except FileExistsError:  # another rank of the job made it first: it is that rank's to remove
            pass
    return created[::-1]


def _remove_empty(created: List[str]) -> None:
    """Remove the directories _make_missing created, deepest first, as long as they are empty."""
    for path in created:
        try:
            os.rmdir(path)
        except OSError:  # something was written (or another rank still holds its lock): keep it and its parents
            return


@contextmanager
def output_lock(directory: str, rank: int = 0, log=lambda message: print(message, file=sys.stderr)) -> Iterator[str]:
    """Hold the lock of `directory` (created if missing) for this rank during the block -> the lock file's path.

    Raises UserError naming the holder when another live process holds it. When the block raises, the directories
    this call created are removed if nothing was written into them."""
    created = _make_missing(directory)
    try:
        fd = _locked(directory, rank)
    except BaseException:
        _remove_empty(created)
        raise
    path, failed = lock_path(directory, rank), False
    try:
        stale = _holder(fd)
        if stale is not None:
            log(f"{path}: taking over the lock of {_describe(stale)}: that process is gone (it did not exit "
                f"normally; what it left half-written is redone)")
        record = {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        yield path
    except BaseException:
        failed = True
        raise
    finally:
        try:
            os.unlink(path)  # while still holding it: a waiter that opened this file sees it is gone and retries
        except FileNotFoundError:  # the directory was removed under us
            pass
        os.close(fd)
        if failed:
            _remove_empty(created)


def _locked(directory: str, rank: int) -> int:
    """The open, flock-ed lock file of `directory` for this rank -> its fd; UserError naming a live holder."""
    path = lock_path(directory, rank)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise UserError(
                f"{directory} is in use by another dflash-fast run ({_describe(holder)}); wait for it to finish, "
                f"stop it, or write somewhere else (its lock: {path})"
            ) from None
        try:
            same_file = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same_file = False
        if same_file:
            break
        os.close(fd)  # its holder released and removed it between our open and flock: lock the new one
    return fd
