"""The environment a test hands a subprocess: this process's, without the launcher variables. Tests that
initialise torch.distributed in the pytest process leave RANK / MASTER_PORT (a port still bound here) in
os.environ; a child that inherits them joins or binds that port (EADDRINUSE) instead of starting its own."""
import os

LAUNCHER = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launch_env(*drop: str, **extra: str) -> dict:
    """os.environ without LAUNCHER and `drop`, updated with `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER + drop}
    env.update(extra)
    return env
