"""How a command ends when something is wrong: one `error: ...` line and an exit status, or a bug's traceback.

    ConfigError (a bad flag, config key or value)                  ->  error: ...   exit 2 (usage)
    ValueError, OSError, UserError (bad data, a missing file, a     ->  error: ...   exit 1
      missing tool, a non-finite loss: the message says the fix)
    KeyboardInterrupt                                               ->  error: interrupted   exit 130
    any other exception (TypeError, KeyError, ...: a bug)           ->  the traceback, exit 1

Every `dflash-fast` command and `train.py` end this way. `--debug` on the command line, or `DFLASH_DEBUG=1` in
the environment, shows the traceback of every error.

A file a user may hand us is read through `read_mapping`, and the shape of what it holds is declared once, next to
its reader, with `Obj` / `ListOf` / `MapOf` / `Nullable` / `Is` (store_format.MANIFEST_SCHEMA, checkpoint.MARKER_SCHEMA,
layouts.CONFIG_SCHEMAS, ...): `check_schema` turns the first field that does not fit into one error naming the
file and the field's path, `manifest.json: shards[3].num_tokens must be a non-negative integer, got "12"`.
"""
import json
import os
import sys
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Dict, Optional, Type, Union

DEBUG_ENV = "DFLASH_DEBUG"


class UserError(RuntimeError):
    """A failure that is neither bad data (ValueError) nor a missing file (OSError) but whose message says what
    is wrong and how to fix it (a missing tool, a non-finite loss): shown as one line, without a traceback."""


class ConfigError(ValueError):
    """A config key or value is wrong; the message names it and the fix."""


# ---------------------------------------------------------------- the shape of a JSON file, declared


@dataclass(frozen=True)
class Is:
    """A leaf of a schema: `test(value)` holds, else the value is not `what` ("a non-negative integer")."""

    what: str
    test: Callable[[Any], bool]


@dataclass(frozen=True)
class ListOf:
    """A JSON list whose every item is `item`."""

    item: "Schema"


@dataclass(frozen=True)
class MapOf:
    """A JSON object of any keys whose every value is `value`."""

    value: "Schema"


@dataclass(frozen=True)
class Obj:
    """A JSON object with the `required` keys and, when present, the `optional` ones (other keys pass unread)."""

    required: Dict[str, "Schema"]
    optional: Dict[str, "Schema"] = field(default_factory=dict)


@dataclass(frozen=True)
class Nullable:
    """`schema`, or null."""

    schema: "Schema"


Schema = Union[Is, ListOf, MapOf, Obj, Nullable]


def is_int(v) -> bool:
    """An int that is not a bool (JSON's true would otherwise pass as 1)."""
    return isinstance(v, int) and not isinstance(v, bool)


STR = Is("a string", lambda v: isinstance(v, str))
BOOL = Is("true or false", lambda v: isinstance(v, bool))
INT = Is("an integer", is_int)
COUNT = Is("a non-negative integer", lambda v: is_int(v) and v >= 0)
POSITIVE = Is("a positive integer", lambda v: is_int(v) and v > 0)
NUMBER = Is("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))
SHA256 = Is("a sha256 digest (64 lowercase hex digits)",
            lambda v: isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v))
OBJECT = Obj({})
LIST = Is("a list", lambda v: isinstance(v, list))
# A safetensors index (a target's or an export's model.safetensors.index.json): tensor name -> shard file.
WEIGHTS_INDEX_SCHEMA = Obj({"weight_map": MapOf(STR)})


def _describe(schema: Schema) -> str:
    if isinstance(schema, Nullable):
        return f"{_describe(schema.schema)} or null"
    if isinstance(schema, Is):
        return schema.what
    if isinstance(schema, ListOf):
        return f"a list of {_plural(schema.item)}"
    return "an object"


def _plural(schema: Schema) -> str:
    what = _describe(schema)
    return {"a non-negative integer": "non-negative integers", "a positive integer": "positive integers",
            "an integer": "integers", "a string": "strings", "an object": "objects"}.get(what, what)


def _shown(value) -> str:
    if isinstance(value, (dict, list)):
        return "an object" if isinstance(value, dict) else "a list"
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _problem(value, schema: Schema, path: str, root: str = "the file") -> Optional[str]:
    """The first place where `value` does not have the shape `schema` declares, as one sentence; None when none."""
    if isinstance(schema, Nullable):
        return None if value is None else _problem(value, schema.schema, path, root)
    if isinstance(schema, Is):
        return None if schema.test(value) else f"{path or root} must be {schema.what}, got {_shown(value)}"
    if isinstance(schema, ListOf):
        if not isinstance(value, list):
            return f"{path or root} must be {_describe(schema)}, got {_shown(value)}"
        return next((p for i, v in enumerate(value) if (p := _problem(v, schema.item, f"{path}[{i}]"))), None)
    if not isinstance(value, dict):
        return f"{path or root} must be an object, got {_shown(value)}"
    prefix = f"{path}." if path else ""
    if isinstance(schema, MapOf):
        return next((p for k, v in value.items() if (p := _problem(v, schema.value, f"{prefix}{k}"))), None)
    for key, sub in schema.required.items():
        if key not in value:
            return f"{prefix}{key} is missing (it must be {_describe(sub)})"
        if (p := _problem(value[key], sub, f"{prefix}{key}")) is not None:
            return p
    return next((p for key, sub in schema.optional.items()
                 if key in value and (p := _problem(value[key], sub, f"{prefix}{key}"))), None)


def schema_problem(value, schema: Schema, root: str = "the file") -> Optional[str]:
    """The first field of `value` that does not have the shape `schema` declares, named by its path
    (`shards[3].num_tokens must be a non-negative integer, got "12"`; `root` names the value itself); None when
    every field fits."""
    return _problem(value, schema, "", root)


def check_schema(value, schema: Schema, where: str, error: Type[Exception] = ValueError):
    """`value` when it has the shape `schema` declares, else `error("<where>: <field> must be ...")`."""
    problem = schema_problem(value, schema)
    if problem is not None:
        raise error(f"{where}: {problem}")
    return value


def read_mapping(path: str, parse: Callable[[IO[str]], Any], syntax: Type[Exception], error: Type[Exception],
                 language: str, what: str, missing: Optional[Type[Exception]] = None,
                 schema: Optional[Obj] = None) -> Dict:
    """The mapping `parse` reads from the file at `path` (a training config, an export's JSON, a store's manifest
    or shard index, a checkpoint's marker). Each failure is one error naming the file: it does not exist
    (`missing`, default `error`), it is not valid `language` (`parse` raised `syntax`, or the nesting is too deep
    to parse), it holds something other than a mapping (`what` names the mapping expected), or a field does not
    have the shape `schema` declares (the error names the field's path): `error`."""
    try:
        with open(path) as f:
            data = parse(f)
    except FileNotFoundError:
        raise (missing or error)(f"{path} does not exist") from None
    except syntax as e:
        raise error(f"{path} is not valid {language}: {e}") from None
    except RecursionError:
        raise error(f"{path} is not valid {language}: it is nested too deeply to parse") from None
    if not isinstance(data, dict):
        raise error(f"{path} holds a {type(data).__name__}, not {what}")
    return data if schema is None else check_schema(data, schema, path, error)


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


def read_json_object(path: str, what: str, schema: Optional[Obj] = None) -> Dict:
    """read_mapping for a JSON object a user supplies with a model (a target's config.json or safetensors index):
    every failure one ValueError naming the file and, with `schema`, the field."""
    return read_mapping(path, json.load, json.JSONDecodeError, ValueError, "JSON", what, schema=schema)


def check_config(ok: bool, message: str) -> None:
    """A config check: ConfigError(message) unless `ok`."""
    if not ok:
        raise ConfigError(message)
