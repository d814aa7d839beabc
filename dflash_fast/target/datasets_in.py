"""Hugging Face datasets as `--data`: rows read with the `datasets` library, mapped by a preset to our records.

    --data DIR (save_to_disk, or a hub dataset's files) | FILE.parquet | FILE.arrow | owner/name (the hub, streamed)
        ──rows (--split, --max-samples)──▶ preset ──▶ {"conversations": [...], "tools"?} | {"text"} | {"input_ids"}

The records are those records.py reads from JSONL (and regenerate's prompts), so a dataset goes through
regenerate -> extract -> train with no conversion script (xLAM's function-calling rows included: JSON columns
parsed, each answer an assistant tool call). A row's preset is the first of PRESETS whose columns it
holds (a column holding None counts as absent: parquet gives every row every column of the file). A row that fits
no preset is one error naming the columns found.
"""
import json
import os
import re
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from dflash_fast.errors import UserError
from dflash_fast.target.text import ROLE_ALIASES

DATASET_SUFFIXES = (".parquet", ".arrow")
SAVED_MARKERS = ("dataset_dict.json", "state.json")  # what save_to_disk writes (a DatasetDict / a Dataset)
_HUB_DATASET = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
# Turn keys kept beside role and content: reasoning (records.REASONING_KEYS) and an assistant's tool calls.
TURN_KEYS = ("thinking", "reasoning_content", "tool_calls", "name", "tool_call_id")


class NoPreset(ValueError):
    """A dataset row that no preset maps to a record."""


def is_dataset(data) -> bool:
    """`data` names a Hugging Face dataset rather than a JSONL file: a directory (save_to_disk's, or a hub dataset's
    files), a .parquet or .arrow file, or `owner/name` that is no local path (a hub id)."""
    data = str(data)
    if data.endswith(DATASET_SUFFIXES) or os.path.isdir(data):
        return True
    return not os.path.exists(data) and bool(_HUB_DATASET.match(data)) and not data.endswith((".jsonl", ".json"))


def _datasets():
    try:
        import datasets
    except ImportError:
        raise UserError("reading a Hugging Face dataset needs the `datasets` package: "
                        "pip install 'dflash-fast[datasets]' (or pip install datasets)") from None
    return datasets


def open_dataset(data: str, split: str = "train"):
    """The rows of `data`'s `split`: a datasets.Dataset (local), or an IterableDataset streamed from the hub."""
    datasets = _datasets()
    if os.path.isdir(data) and not any(os.path.exists(os.path.join(data, f)) for f in SAVED_MARKERS):
        try:  # a hub dataset's files downloaded as they are (data/train-00000-of-00001.parquet, ...)
            return datasets.load_dataset(data, split=split)
        except Exception as e:  # no data files, an unknown split: the library's own reasons
            raise ValueError(f"{data} is a directory that neither `datasets` save_to_disk wrote nor load_dataset "
                             f"reads ({type(e).__name__}: {e}); give a JSONL file, a .parquet / .arrow file, a saved "
                             f"dataset or a folder of a hub dataset's files") from None
    if os.path.isdir(data):
        ds = datasets.load_from_disk(data)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"{data} has no split {split!r}: its splits are {sorted(ds)}; pass --split NAME")
            ds = ds[split]
        return ds
    if data.endswith(DATASET_SUFFIXES):
        if not os.path.isfile(data):
            raise FileNotFoundError(f"{data} does not exist")
        if data.endswith(".arrow"):
            return datasets.Dataset.from_file(data)
        import pyarrow.parquet as pq

        return datasets.Dataset(pq.read_table(data))
    try:
        return datasets.load_dataset(data, split=split, streaming=True)
    except Exception as e:  # the hub unreachable, no such dataset or split: the library's own reasons
        raise ValueError(f"{data} is no local file and the hub did not give it as a dataset "
                         f"({type(e).__name__}: {e}); give a local path or a reachable hub id") from None


def dataset_rows(data: str, split: str = "train", max_samples: Optional[int] = None) -> Iterator[Tuple[str, Dict]]:
    """(where, row) of the first `max_samples` rows (all when None); where: "DATA[split] row i" for errors."""
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"--max-samples must be >= 1, got {max_samples}")
    ds = open_dataset(str(data), split)
    for i, row in enumerate(ds):
        if max_samples is not None and i >= max_samples:
            return
        yield f"{data}[{split}] row {i}", row


def _present(row: Dict) -> set:
    return {k for k, v in row.items() if v is not None}


def _turns(turns) -> List[Dict]:
    """Turns as {role, content, ...}: ShareGPT's from/value (human, gpt) renamed, None-valued struct fields dropped
    (parquet fills every field of a turn struct), a tool-calling turn's missing content made ""."""
    if not isinstance(turns, list):
        return turns  # records.py names the problem
    out = []
    for t in turns:
        if not isinstance(t, dict):
            out.append(t)
            continue
        role = t.get("role", t.get("from"))
        turn = {"role": ROLE_ALIASES.get(role, role), "content": t.get("content", t.get("value"))}
        turn.update((k, t[k]) for k in TURN_KEYS if t.get(k) is not None)
        if turn["content"] is None and turn.get("tool_calls"):
            turn["content"] = ""
        out.append(turn)
    return out


def _json_column(row: Dict, column: str):
    """A column that holds JSON as a string (xLAM's), parsed; NoPreset naming the column when it is not JSON."""
    value = row[column]
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise NoPreset(f"its {column!r} is a string but not JSON ({e})") from None


def _xlam_tool(tool) -> Dict:
    """An xLAM tool {name, description, parameters: {arg: {type, description, default?}}} as a chat template's
    function definition: {"type": "function", "function": {name, description, parameters: a JSON schema}}."""
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise NoPreset(f"an entry of its 'tools' is not a {{name, description, parameters}} object: {tool!r}")
    parameters = tool.get("parameters") or {}
    if isinstance(parameters, dict) and "properties" not in parameters:
        parameters = {"type": "object", "properties": parameters}
    return {"type": "function", "function": {**tool, "parameters": parameters}}


def _xlam(row: Dict) -> Dict:
    """Salesforce xlam-function-calling-60k: the user's `query`, the `tools` offered and the `answers` (the calls
    made, [{name, arguments}]), the last two as JSON strings -> a user turn and an assistant turn of tool calls."""
    tools, answers = _json_column(row, "tools"), _json_column(row, "answers")
    if not isinstance(tools, list) or not isinstance(answers, list) or not all(
            isinstance(a, dict) and isinstance(a.get("name"), str) for a in answers):
        raise NoPreset("its 'tools' and 'answers' must be JSON lists ({name, ...} objects each)")
    calls = [{"type": "function", "function": {"name": a["name"], "arguments": a.get("arguments", {})}}
             for a in answers]
    return {"conversations": [{"role": "user", "content": row["query"]},
                              {"role": "assistant", "content": "", "tool_calls": calls}],
            "tools": [_xlam_tool(t) for t in tools]}


def _chat(user: str, reply: str) -> Dict:
    return {"conversations": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]}


def _codealpaca(row: Dict) -> Dict:
    extra = row.get("input")
    return _chat(row["instruction"] + (f"\n\n{extra}" if isinstance(extra, str) and extra.strip() else ""),
                 row["output"])


# name -> (the columns a row must hold, their description, row -> record); the first that fits wins.
PRESETS: Dict[str, Tuple[Callable[[set], bool], str, Callable[[Dict], Dict]]] = {
    "xlam": (lambda c: {"query", "tools", "answers"} <= c,
             "query + tools + answers, JSON strings (xLAM function calling)", _xlam),
    "tools": (lambda c: "tools" in c and bool(c & {"messages", "conversations"}),
              "tools + messages|conversations (function calling)",
              lambda r: {"conversations": _turns(r.get("messages", r.get("conversations"))),
                         "tools": _json_column(r, "tools")}),
    "sharegpt": (lambda c: "conversations" in c, "conversations of from/value or role/content (ShareGPT, "
                 "PerfectBlend, Magpie-Pro)", lambda r: {"conversations": _turns(r["conversations"])}),
    "messages": (lambda c: "messages" in c, "messages of role/content (UltraChat)",
                 lambda r: {"conversations": _turns(r["messages"])}),
    "magpie": (lambda c: {"instruction", "response"} <= c, "instruction + response (Magpie)",
               lambda r: _chat(r["instruction"], r["response"])),
    "codealpaca": (lambda c: {"instruction", "output"} <= c, "instruction (+ input) + output (CodeAlpaca, Alpaca)",
                   _codealpaca),
    "opencodeinstruct": (lambda c: {"input", "output"} <= c, "input + output (OpenCodeInstruct)",
                         lambda r: _chat(r["input"], r["output"])),
    "text": (lambda c: "text" in c, "text", lambda r: {"text": r["text"]}),
    "pretokenized": (lambda c: "input_ids" in c, "input_ids (+ loss_mask)",
                     lambda r: {"input_ids": list(r["input_ids"]),
                                **({"loss_mask": list(r["loss_mask"])} if r.get("loss_mask") is not None else {})}),
}


def preset_of(row: Dict) -> str:
    """The name of the first preset whose columns `row` holds; NoPreset naming the columns found otherwise."""
    columns = _present(row)
    for name, (fits, _, _) in PRESETS.items():
        if fits(columns):
            return name
    described = "; ".join(f"{name}: {what}" for name, (_, what, _) in PRESETS.items())
    raise NoPreset(f"fits no preset: columns found {sorted(row)} (non-empty: {sorted(columns)}); the presets read "
                   f"{described}. Rename the columns to one of them")


def to_record(row: Dict) -> Dict:
    """A dataset row as the record records.py and regenerate read (see PRESETS)."""
    return PRESETS[preset_of(row)][2](row)
