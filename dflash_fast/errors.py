"""How a command ends when something is wrong: one `error: ...` line and an exit status, or a bug's traceback.

    ConfigError (a bad flag, config key or value)                  ->  error: ...   exit 2 (usage)
    ValueError, OSError, UserError (bad data, a missing file, a     ->  error: ...   exit 1
      missing tool, a non-finite loss: the message says the fix)
    KeyboardInterrupt                                               ->  error: interrupted   exit 130
    any other exception (TypeError, KeyError, ...: a bug)           ->  the traceback, exit 1

Every `dflash-fast` command and `train.py` end this way. `--debug` on the command line, or `DFLASH_DEBUG=1` in
the environment, shows the traceback of every error.
"""
import os
import sys
from typing import IO, Any, Callable, Dict, Optional, Type

DEBUG_ENV = "DFLASH_DEBUG"


class UserError(RuntimeError):
    """A failure that is neither bad data (ValueError) nor a missing file (OSError) but whose message says what
    is wrong and how to fix it (a missing tool, a non-finite loss): shown as one line, without a traceback."""


class ConfigError(ValueError):
    """A config key or value is wrong; the message names it and the fix."""


def read_mapping(path: str, parse: Callable[[IO[str]], Any], syntax: Type[Exception], error: Type[Exception],
                 language: str, what: str, missing: Optional[Type[Exception]] = None) -> Dict:
    """The mapping `parse` reads from the file at `path` (a training config, an export's JSON, a store's manifest
    or shard index). Each failure is one error naming the file: it does not exist (`missing`, default `error`),
    it is not valid `language` (`parse` raised `syntax`), or it holds something other than a mapping (`what`
    names the mapping expected): `error`."""
    try:
        with open(path) as f:
            data = parse(f)
    except FileNotFoundError:
        raise (missing or error)(f"{path} does not exist") from None
    except syntax as e:
        raise error(f"{path} is not valid {language}: {e}") from None
    if not isinstance(data, dict):
        raise error(f"{path} holds a {type(data).__name__}, not {what}")
    return data


def debug_requested(flag: bool = False) -> bool:
    return flag or os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def run_reporting_errors(fn: Callable[[], Optional[int]], debug: bool = False) -> int:
    """fn() -> its exit status (None = 0); a user error -> its one line on stderr and 2 or 1 (module docstring)."""
    try:
        return fn() or 0
    except (UserError, ValueError, OSError, KeyboardInterrupt) as e:
        if debug_requested(debug):
            raise
        if isinstance(e, KeyboardInterrupt):
            print("error: interrupted", file=sys.stderr)
            return 130
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
