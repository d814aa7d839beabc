"""The public benchmarks of published acceptance tables, as prompt sets for `dflash-fast eval --benchmark`.

    BENCHMARKS      name -> Benchmark: its public dataset, the columns read, the rendering into user turns, the
                    new-token budget (one table: a benchmark is a row of it)
    read_rows       a local JSONL or parquet file (pyarrow), or the hub through `datasets` -> records
    load_suites     `--benchmark a,b=PATH` + `--benchmark-dir DIR` -> [Suite]: every record rendered before a model
                    loads
    decode_suite    a suite through a decode callback, turn by turn: a second turn (mt-bench) is asked after the
                    target's own first answer, as z-lab's benchmark does
    benchmarks_report, markdown_table  one row per benchmark; the table laid out as the published ones (benchmarks
                    as columns; tau, tau_zlab, acceptance per drafted position as rows)

Each record is read in its public dataset's own columns and rendered as z-lab's `dflash` 0.1.0 benchmark.py renders
it (gsm8k, math500, humaneval, mbpp, mt-bench); the benchmarks it lacks follow SpecForge's benchmarks/benchmarker
(aime, livecodebench, alpaca) or the dataset's own harness (arena-hard, SPEED-Bench: the user turns as given).
A subset (`--num-prompts N`) is z-lab's: the records shuffled by random.Random(42), the first N taken.
"""

import json
import os
import random
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from dflash_fast.errors import ConfigError, UserError
from dflash_fast.evaluate.report import Tally, report
from dflash_fast.target.prompts import Prompt
from dflash_fast.target.text import text_problem

BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```"
Z_LAB_BUDGET = 2048  # z-lab benchmark's --max-new-tokens default, for every dataset


def column(record: Dict, names: Sequence[str]):
    """The first of `names` the record holds (datasets name one column differently across configs / versions)."""
    for name in names:
        if name in record:
            return record[name]
    raise ValueError(f"has none of the columns {', '.join(names)} (its columns: {', '.join(map(str, record))})")


def text(record: Dict, names: Sequence[str]) -> str:
    """The first of `names` the record holds, which must be a string."""
    value = column(record, names)
    if not isinstance(value, str):
        raise ValueError(f"column {names[0]} must be text, got {value!r}"[:300])
    return value


def _texts(value, what: str) -> List[str]:
    """A turn list: strings, or {"content": ...} objects (arena-hard v0.1)."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ValueError(f"{what} must be a string or a non-empty list of turns, got {value!r}"[:300])
    return [t.get("content") if isinstance(t, dict) else t for t in value]


def _alpaca(r: Dict) -> List[str]:
    instruction, given = text(r, ["instruction"]), r.get("input") or ""
    extra = f"### Input:\n{given}\n\n" if given else ""
    return [f"### Instruction:\n{instruction}\n\n{extra}### Response:"]


@dataclass(frozen=True)
class Benchmark:
    hub: Tuple[Optional[str], ...]  # the public dataset: (datasets id, config or None, split)
    columns: Tuple[str, ...]  # the columns `turns` reads (alternatives where configs / versions differ)
    turns: Callable[[Dict], List[str]]  # a record -> its user turns, rendered
    max_new_tokens: int
    rendering: str  # where the rendering comes from
    also: Tuple[str, ...] = field(default=())  # other public sources in the same columns


BENCHMARKS: Dict[str, Benchmark] = {
    "gsm8k": Benchmark(("openai/gsm8k", "main", "test"), ("question",),
                       lambda r: [text(r, ["question"]) + BOXED], Z_LAB_BUDGET, "z-lab"),
    "math500": Benchmark(("HuggingFaceH4/MATH-500", None, "test"), ("problem",),
                         lambda r: [text(r, ["problem"]) + BOXED], Z_LAB_BUDGET, "z-lab"),
    "aime": Benchmark(("math-ai/aime25", None, "test"), ("problem", "Problem"),
                      lambda r: [text(r, ["problem", "Problem"]) + BOXED], Z_LAB_BUDGET, "SpecForge (aime25)",
                      also=("yentinglin/aime_2025", "HuggingFaceH4/aime_2024", "Maxwell-Jia/AIME_2024")),
    "humaneval": Benchmark(("openai/openai_humaneval", None, "test"), ("prompt",),
                           lambda r: [HUMANEVAL.format(text(r, ["prompt"]))], Z_LAB_BUDGET, "z-lab"),
    "mbpp": Benchmark(("google-research-datasets/mbpp", "sanitized", "test"), ("prompt", "text"),
                      lambda r: [text(r, ["prompt", "text"])], Z_LAB_BUDGET, "z-lab (the full config's `text`)"),
    "livecodebench": Benchmark(("livecodebench/code_generation_lite", None, "test"), ("question_content",),
                               lambda r: [text(r, ["question_content"]).strip()], Z_LAB_BUDGET, "SpecForge"),
    "mt-bench": Benchmark(("HuggingFaceH4/mt_bench_prompts", None, "train"), ("prompt", "turns"),
                          lambda r: _texts(column(r, ["prompt", "turns"]), "prompt"), Z_LAB_BUDGET,
                          "z-lab (both turns)", also=("FastChat's mt_bench question.jsonl (turns)",)),
    "alpaca": Benchmark(("tatsu-lab/alpaca", None, "train"), ("instruction", "input"), _alpaca, Z_LAB_BUDGET,
                        "SpecForge"),
    "arena-hard": Benchmark(("lmarena-ai/arena-hard-auto-v0.1", None, "train"), ("prompt", "turns"),
                            lambda r: _texts(column(r, ["prompt", "turns"]), "turns"), Z_LAB_BUDGET,
                            "arena-hard-auto (v2.0 `prompt`, v0.1 `turns[].content`)",
                            also=("lmarena-ai/arena-hard-auto: data/arena-hard-v2.0/question.jsonl (prompt)",)),
    "speed-bench": Benchmark(("nvidia/SPEED-Bench", "qualitative", "test"), ("turns",),
                             lambda r: _texts(column(r, ["turns"]), "turns"), Z_LAB_BUDGET, "SPEED-Bench (its turns)"),
}
ALIASES = {"mtbench": "mt-bench", "arenahard": "arena-hard", "arena-hard-v2": "arena-hard", "speedbench": "speed-bench",
           "aime25": "aime", "aime24": "aime", "math-500": "math500", "lcb": "livecodebench"}


def benchmark_name(name: str) -> str:
    """`MT_Bench`, `mtbench`, `SPEED-Bench` -> the table's name, or a ConfigError listing the names."""
    key = name.strip().lower().replace("_", "-")
    key = ALIASES.get(key, ALIASES.get(key.replace("-", ""), key))
    if key not in BENCHMARKS:
        raise ConfigError(f"--benchmark {name}: unknown benchmark; known: {', '.join(BENCHMARKS)}")
    return key


def read_rows(path: str, hub: Tuple[Optional[str], ...] = ()) -> List[Tuple[str, Dict]]:
    """(where, record) from a JSONL file, a parquet file (needs pyarrow) or, for PATH `hub`, the public dataset
    through `datasets` (needs it installed and the hub reachable)."""
    if path == "hub":
        try:
            import datasets
        except ImportError:
            raise UserError("reading a benchmark from the hub needs `datasets` (pip install datasets), or download "
                            "the file and pass NAME=PATH") from None
        repo, config, split = hub
        rows = datasets.load_dataset(repo, config, split=split)
        return [(f"{repo}[{i}]", dict(r)) for i, r in enumerate(rows)]
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise UserError(f"{path}: reading parquet needs pyarrow (pip install pyarrow), or convert the file "
                            "to JSONL") from None
        return [(f"{path}[{i}]", r) for i, r in enumerate(pq.read_table(path).to_pylist())]
    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, RecursionError) as e:
                    raise ValueError(f"{path}:{line_no}: not valid JSON ({e}); fix or delete the line") from None
                if not isinstance(record, dict):
                    raise ValueError(f"{path}:{line_no}: expected a JSON object (a dataset row), got {record!r}"[:300])
                rows.append((f"{path}:{line_no}", record))
    return rows


@dataclass
class Suite:
    """One benchmark's prompt set: each record's user turns, rendered, and where each came from."""

    name: str
    path: str
    max_new_tokens: int
    conversations: List[List[str]]
    where: List[str]


def render(name: str, where: str, record: Dict) -> List[str]:
    """A record's user turns by BENCHMARKS[name]; a bad record raises naming its file and line."""
    try:
        turns = BENCHMARKS[name].turns(record)
        for i, t in enumerate(turns):
            if not isinstance(t, str):
                raise ValueError(f"turn {i} is not text: {t!r}"[:300])
            problem = text_problem(t)
            if problem:
                raise ValueError(f"turn {i} {problem}")
    except ValueError as e:
        raise ValueError(f"{where}: not a {name} record: {e}; give the file in the public dataset's columns "
                         f"({', '.join(BENCHMARKS[name].columns)})") from None
    return turns


def find_file(name: str, directory: str) -> str:
    """DIR/NAME.jsonl or DIR/NAME.parquet (NAME as the table names it, or with `_` for `-`)."""
    names = [f"{n}{ext}" for n in dict.fromkeys([name, name.replace("-", "_")]) for ext in (".jsonl", ".parquet")]
    for n in names:
        if os.path.exists(os.path.join(directory, n)):
            return os.path.join(directory, n)
    repo, config, split = BENCHMARKS[name].hub
    raise FileNotFoundError(f"--benchmark {name}: none of {', '.join(names)} in {directory}; download {repo}"
                            f"{f' ({config})' if config else ''} split {split} there (docs/evaluation.md)")


def load_suites(benchmark: str, benchmark_dir: Optional[str] = None, num_prompts: Optional[int] = None) -> List[Suite]:
    """`gsm8k,mt-bench=PATH,...` -> one Suite per name, each file read and every record rendered (before any model
    loads). A name without `=PATH` is read from benchmark_dir; PATH `hub` loads the public dataset itself."""
    suites = []
    for item in [s for s in benchmark.split(",") if s.strip()]:
        raw, _, path = item.partition("=")
        name = benchmark_name(raw)
        if not path:
            if benchmark_dir is None:
                raise ConfigError(f"--benchmark {raw}: give its file as {raw}=PATH or a --benchmark-dir holding "
                                  f"{name}.jsonl / {name}.parquet")
            path = find_file(name, benchmark_dir)
        rows = read_rows(path, BENCHMARKS[name].hub)
        if not rows:
            raise ValueError(f"{path}: no records for {name}")
        order = list(range(len(rows)))
        random.Random(42).shuffle(order)  # z-lab benchmark's _select_dataset
        rows = [rows[i] for i in order[: num_prompts if num_prompts is not None else len(rows)]]
        suites.append(Suite(name, path, BENCHMARKS[name].max_new_tokens, [render(name, w, r) for w, r in rows],
                            [w for w, _ in rows]))
    if not suites:
        raise ConfigError("--benchmark names no benchmark; e.g. --benchmark gsm8k,mt-bench")
    if len({s.name for s in suites}) != len(suites):
        raise ConfigError(f"--benchmark {benchmark}: a benchmark is named twice")
    return suites


# decode(prompt ids per conversation, max_new_tokens, tally): decodes each into `tally` (one SpecResult each, in order)
Decode = Callable[[List[List[int]], int, Tally], None]


def decode_suite(suite: Suite, block_size: int, encode: Callable[[Prompt], List[int]], decode: Decode,
                 answer: Callable[[List[int]], str], max_new_tokens: Optional[int] = None) -> Tally:
    """Every conversation of `suite` decoded turn by turn into one Tally: turn k of each conversation is asked
    after its turns 1..k-1 and the target's own answers to them (`answer`: output tokens -> text). The tally holds
    every conversation's first turn, then every second turn, ... (the order of `per_prompt` in the report)."""
    tally = Tally(block_size)
    history: List[List[Dict[str, str]]] = [[] for _ in suite.conversations]
    for k in range(max(len(c) for c in suite.conversations)):
        live = [i for i, c in enumerate(suite.conversations) if k < len(c)]
        for i in live:
            history[i].append({"role": "user", "content": suite.conversations[i][k]})
        start = len(tally.results)
        decode([encode(Prompt(i, {}, messages=list(history[i]), where=suite.where[i])) for i in live],
               max_new_tokens or suite.max_new_tokens, tally)
        if len(tally.results) != start + len(live):
            raise RuntimeError(f"decode added {len(tally.results) - start} results for {len(live)} prompts")
        for i, spec in zip(live, tally.results[start:]):
            history[i].append({"role": "assistant", "content": answer(spec.tokens)})
    return tally


TAU_DEFINITIONS = {
    "tau": "ours: tokens per verification forward, all blocks of all prompts pooled, each block n + 1 uncut",
    "tau_zlab": "z-lab dflash 0.1.0 benchmark.py's 'Average Acceptance length': each block's length cut at the stop "
                "token / token limit, averaged per prompt (per turn), then over prompts",
}


def first_prompt(suites: List[Suite]) -> Prompt:
    """The first user turn of the first suite (a warm-up prompt)."""
    suite = suites[0]
    return Prompt(0, {}, messages=[{"role": "user", "content": suite.conversations[0][0]}], where=suite.where[0])


def decode_suites(suites: List[Suite], block_size: int, encode: Callable[[Prompt], List[int]], decode: Decode,
                  answer: Callable[[List[int]], str], max_new_tokens: Optional[int]) -> List[Tally]:
    """Each suite decoded (decode_suite) into a Tally of its own, in order."""
    return [decode_suite(suite, block_size, encode, decode, answer, max_new_tokens) for suite in suites]


def first_row(report: Dict) -> Dict:
    """The row of a report of one benchmark (benchmarks_report: its first row) or of --data (the report itself)."""
    return report["benchmarks"][0] if "benchmarks" in report else report


def benchmarks_report(suites: List[Suite], tallies: List[Tally], baseline: bool, max_new_tokens: Optional[int],
                      header: Dict) -> Dict:
    """Each suite's tally (decode_suites, any engine) as one report row (report.report, plus `benchmark`, `file`,
    `dataset`, `rendering`, `prompts`, `turns`) under `header` (the run's engine, target, drafter, ...), with both tau
    definitions named and the markdown table."""
    rows = []
    for suite, tally in zip(suites, tallies):
        table = BENCHMARKS[suite.name]
        rows.append(report(tally, baseline, benchmark=suite.name, file=suite.path, dataset=table.hub[0],
                           rendering=table.rendering, prompts=len(suite.conversations), turns=len(tally.results),
                           max_new_tokens=max_new_tokens or suite.max_new_tokens))
    out = {**header, "tau_definitions": TAU_DEFINITIONS, "benchmarks": rows}
    out["table"] = markdown_table(out)
    return out


def _num(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_table(report: Dict, *others: Dict) -> str:
    """Benchmarks as columns, as the published tables: tau, tau_zlab, then the fraction of blocks that accepted
    each drafted position, and the prompts (turns) measured. `others`: the same benchmarks measured another way
    (vLLM's report of the same run): each cell then holds every report's value, joined by " / " in the order
    given."""
    reports = (report, *others)
    rows = report["benchmarks"]
    positions = max((len(r["acceptance_by_position"]) for rep in reports for r in rep["benchmarks"]), default=0)
    lines = ["| | " + " | ".join(r["benchmark"] for r in rows) + " |", "| --- |" + " ---: |" * len(rows)]

    def line(label, cell):
        lines.append(f"| {label} | " + " | ".join(" / ".join(cell(rep["benchmarks"][i]) for rep in reports)
                                                   for i in range(len(rows))) + " |")

    def accepted(j):
        return lambda r: (_num(r["acceptance_by_position"][j]["accepted"], 3)
                          if j < len(r["acceptance_by_position"]) else "-")

    line("tau (pooled)", lambda r: _num(r["tau"], 2))
    line("tau_zlab (per-prompt mean, cut)", lambda r: _num(r.get("tau_zlab"), 2))
    for j in range(positions):
        line(f"accepted @{j + 1}", accepted(j))
    line("prompts (turns)", lambda r: f"{r['prompts']} ({r['turns']})")
    return "\n".join(lines)


def write_table(report: Dict, json_path: str) -> str:
    """The report's markdown table beside its JSON (REPORT.json -> REPORT.md) -> that path."""
    path = os.path.splitext(json_path)[0] + ".md"
    with open(path, "w") as f:
        f.write(report["table"] + "\n")
    return path


def add_arguments(p) -> None:
    """`dflash-fast eval`'s benchmark flags."""
    p.add_argument("--benchmark", default=None, metavar="NAME[=PATH],...",
                   help=f"public benchmarks instead of --data, one report row each: {', '.join(BENCHMARKS)}; each "
                        "read from PATH (JSONL or parquet in the dataset's own columns; `hub`: through `datasets`) "
                        "or from --benchmark-dir")
    p.add_argument("--benchmark-dir", default=None, metavar="DIR",
                   help="where --benchmark NAME is read from without =PATH: DIR/NAME.jsonl or DIR/NAME.parquet")
    p.add_argument("--thinking", choices=["on", "off"], default=None,
                   help="the chat template's thinking switch (Qwen3 enable_thinking; gpt-oss reasoning_effort "
                        "high / low); default: the template's own default")


def check_flags(args) -> None:
    """--data or --benchmark, one of them; --data's budget 128."""
    if (args.data is None) == (args.benchmark is None):
        raise ConfigError("dflash-fast eval takes --data PROMPTS.jsonl or --benchmark NAME,..., not both or neither")
    if args.benchmark_dir is not None and args.benchmark is None:
        raise ConfigError("--benchmark-dir is read only with --benchmark")
    if args.max_new_tokens is None and args.benchmark is None:
        args.max_new_tokens = 128
