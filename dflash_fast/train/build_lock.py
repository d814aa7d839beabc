"""A JIT build lock left behind by a killed run, found before DeepSpeed starts and named in one `error:` line.

DeepSpeed builds some of its C++ ops on first use through torch.utils.cpp_extension (on a CPU the communication
op `deepspeed_shm_comm`, built at init_distributed; `cpu_adam` under optimizer offload) into

    $TORCH_EXTENSIONS_DIR/<op>/                     when the variable is set
    ~/.cache/torch_extensions/<py311_cpu>/<op>/     else (python version, then cpu / cuXYZ / rocmXYZ)

Every process that loads such an op, built already or not, first creates `<op>/lock` (O_EXCL, no owner written
into it) and removes it when done; a process that finds the file waits, polling, without a word and without end.
A run killed while it holds the lock (in the minutes a build takes) leaves the file, and every later run on this
cache hangs at start-up with no output.

The rule (stale_locks): a lock is stale when
  - no process on this machine works in its op's directory (the build's ninja and compiler run there:
    /proc/<pid>/cwd; a process of another user, or on another machine sharing the cache, is not seen), and
  - the lock file is older than STALE_AFTER_S: a live loader holds it for a moment before and after ninja
    (writing build.ninja, importing the built library), and a build seen only by its age (another machine)
    is given that long.
A stale lock stops the run (check_build_locks) naming the file to remove; a younger lock with no build seen is
reported in one line, since DeepSpeed is about to wait on it.
"""
import os
import sys
import time
from typing import Callable, List, Optional, Tuple

from dflash_fast.errors import UserError

LOCK = "lock"  # torch.utils.cpp_extension's FileBaton in each op's build directory
STALE_AFTER_S = 600.0


def extensions_root() -> str:
    """The directory torch.utils.cpp_extension builds this interpreter's ops under (its _get_build_directory,
    without creating anything)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is not None:
        return root
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return os.path.join(get_default_build_root(), f"{python}_{accelerator}")


def processes_in(directory: str) -> List[int]:
    """The ids of the processes on this machine whose working directory is `directory` or under it (those this
    user may inspect; [] without /proc)."""
    directory = os.path.realpath(directory)
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            cwd = os.readlink(os.path.join("/proc", entry, "cwd"))
        except OSError:  # gone, or another user's
            continue
        if cwd == directory or cwd.startswith(directory + os.sep):
            found.append(int(entry))
    return found


def build_locks(root: str, now: Optional[float] = None) -> List[Tuple[str, float, List[int]]]:
    """Every op lock under `root` -> (its path, its age in seconds, the processes working in its op's directory)."""
    now = time.time() if now is None else now
    out = []
    for op in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        lock = os.path.join(root, op, LOCK)
        try:
            age = now - os.stat(lock).st_mtime
        except OSError:  # no lock (or it went away just now)
            continue
        out.append((lock, age, processes_in(os.path.dirname(lock))))
    return out


def check_build_locks(root: Optional[str] = None, say: Callable[[str], None] = lambda _line: None,
                      stale_after: float = STALE_AFTER_S) -> None:
    """Refuse to start DeepSpeed over a stale build lock under `root` (default: extensions_root()): one UserError
    naming every stale lock and the command that removes them. A lock held by a build seen running, or younger than
    `stale_after` seconds, is left alone; `say` gets a line for the young one no build was seen holding."""
    root = extensions_root() if root is None else root
    stale = []
    for lock, age, builders in build_locks(root):
        if builders:
            continue
        if age > stale_after:
            stale.append((lock, age))
        else:
            say(f"{lock} exists ({age:.0f} s old) and no process builds in its directory: DeepSpeed waits until it "
                f"is removed; if no build of that op runs anywhere, remove it")
    if stale:
        names = "; ".join(f"{lock} ({age / 60:.0f} minutes old)" for lock, age in stale)
        raise UserError(
            f"stale JIT build lock of a DeepSpeed op: {names}; no process builds there: a run killed while it built "
            f"the op left it, and DeepSpeed would wait on it forever without a word. Remove it "
            f"(rm {' '.join(lock for lock, _ in stale)}) and start again (docs/troubleshooting.md)"
        )
