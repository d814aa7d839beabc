"""The README and docs/*.md cannot drift from the code. In their fenced code blocks and inline `code`:

- every `dflash-fast SUB` is a command of dflash_fast/cli.py, and every `--flag` after it is one of SUB's real
  argparse parser (built by cli.command_parser, as `dflash-fast SUB --help` shows it);
- every `train.py` flag is one `python train.py --help` shows, every `key=value` after `train.py` or
  `dflash-fast quickstart` is a key of config.py's schema, and so is every `section.key` written in code;
- every `--flag` after `scripts/X.py` or `bench/X.py` is one that script's argparse defines;
- every repo path (`configs/tiny.yaml`, `bench/...`, `scripts/...`) and every relative Markdown link exists, and
  every `configs/*.yaml` named loads under the schema.

A made-up flag, key, command or path fails here (the synthetic snippets at the end check that). A line that
shows a mistake on purpose (a misspelt key and the error it gives) ends with `<!-- wrong on purpose -->`."""
import ast
import contextlib
import dataclasses
import functools
import glob
import io
import itertools
import json
import os
import re
import subprocess

import pytest

from dflash_fast import cli
from dflash_fast.train import config, trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC_FILES = ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))

ON_PURPOSE = re.compile(r"^.*<!-- wrong on purpose -->\s*$", re.M)
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
OVERRIDE = re.compile(r"^([A-Za-z_][\w.]*)=")
SECTIONS = tuple(name for name, kind in config._fields(config.TrainConfig).items() if dataclasses.is_dataclass(kind))
SECTION_KEY = re.compile(r"(?<![\w./-])((?:%s)\.[A-Za-z_][\w.]*\w)" % "|".join(SECTIONS))
FILE_SUFFIXES = ("png", "json", "jsonl", "md", "yaml", "py", "safetensors", "bin", "txt")
REPO_PATH = re.compile(r"(?<![\w./-])((?:configs|bench|scripts|tests|dflash_fast|kernels|docs|\.ci)/[\w./{},-]*)")
# Folders that commands make (bench/wheels/ by bench/fetch_wheels.sh): the docs may name them, git ignores them.
OUTPUTS = tuple(line.strip().lstrip("/") for line in open(os.path.join(REPO, ".gitignore"))
                if line.strip().endswith("/") and "/" in line.strip().strip("/"))


@functools.lru_cache(maxsize=None)
def command_flags(name: str) -> frozenset:
    return frozenset(cli.command_parser(name)[1]._option_string_actions)


@functools.lru_cache(maxsize=None)
def train_flags() -> frozenset:
    """The flags `python train.py --help` prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        trainer.parse_args(["--help"])
    return frozenset(FLAG.findall(out.getvalue()))


@functools.lru_cache(maxsize=None)
def script_flags(path: str) -> frozenset:
    """The option strings of every `*.add_argument(...)` call in a script (read, never run)."""
    tree = ast.parse(open(os.path.join(REPO, path)).read())
    return frozenset(
        arg.value for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
        for arg in node.args if isinstance(arg, ast.Constant) and str(arg.value).startswith("-")
    ) | {"-h", "--help"}


def all_flags() -> frozenset:
    scripts = glob.glob(os.path.join(REPO, "scripts", "*.py")) + glob.glob(os.path.join(REPO, "bench", "*.py"))
    return frozenset().union(train_flags(), *(command_flags(n) for n in cli.COMMANDS),
                             *(script_flags(os.path.relpath(p, REPO)) for p in scripts))


def config_key_exists(key: str) -> bool:
    node = config.TrainConfig
    for part in key.split("."):
        fields = {f.name: f for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else {}
        if part not in fields:
            return False
        node = config._fields(node)[part]
    return True


def expand_braces(path: str):
    """configs/ds_zero{1,2,3}.json -> the three names."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return list(itertools.chain.from_iterable(
        expand_braces(path[:m.start()] + alt + path[m.end():]) for alt in m.group(1).split(",")))


def command_problems(line: str) -> list:
    """Problems of one shell command line (continuations joined) or inline code span."""
    line = re.split(r"(?:^|\s)#", line, maxsplit=1)[0]
    found = []
    programs = list(re.finditer(r"(?<![\w/.-])(dflash-fast|train\.py|(?:scripts|bench)/\w+\.py)(?=\s|$)", line))
    for i, m in enumerate(programs):
        end = programs[i + 1].start() if i + 1 < len(programs) else len(line)
        rest = re.split(r"&&|;|\|\|", line[m.end():end], maxsplit=1)[0].split()
        program = m.group(1)
        if program == "dflash-fast":
            if not rest or rest[0] == "...":
                continue
            sub, rest = rest[0].strip("`'\"(),;:"), rest[1:]
            if sub.startswith("-"):
                rest, known = [sub] + rest, {"--help", "-h", "--debug"}
            elif sub not in cli.COMMANDS:
                found.append(f"`dflash-fast {sub}` is not a command (commands: {', '.join(cli.COMMANDS)})")
                continue
            else:
                known = command_flags(sub)
            takes_overrides = sub == "quickstart"
        elif program == "train.py":
            known, takes_overrides = train_flags(), True
        else:
            if not os.path.exists(os.path.join(REPO, program)):
                continue  # the path check names it
            known, takes_overrides = script_flags(program), False
        for flag in FLAG.findall(" ".join(rest)):
            if flag not in known:
                found.append(f"`{flag}` is not a flag of {program} {sub if program == 'dflash-fast' else ''}"
                                .rstrip() + f" (its flags: {', '.join(sorted(known))})")
        if takes_overrides:
            for token in rest:
                o = OVERRIDE.match(token.strip("[]'\""))
                if o and not o.group(1).isupper() and not config_key_exists(o.group(1)):
                    found.append(f"override `{token}`: `{o.group(1)}` is not a config key "
                                 "(dflash_fast/train/config.py)")
    return found


def key_problems(code: str) -> list:
    out = []
    for key in SECTION_KEY.findall(code):
        if not config_key_exists(key) and key.rsplit(".", 1)[-1] not in FILE_SUFFIXES:
            out.append(f"`{key}` is not a config key (dflash_fast/train/config.py)")
    return out


def path_problems(code: str) -> list:
    out = []
    for m in REPO_PATH.finditer(code):
        path = m.group(1).rstrip(".,")
        if code[m.end():m.end() + 1] in ("<", "*") or "..." in path:
            continue  # a placeholder such as bench/results/gpu-<date>/
        for p in expand_braces(path):
            if (p.rstrip("/") + "/").startswith(OUTPUTS):
                continue
            if not os.path.exists(os.path.join(REPO, p)):
                out.append(f"`{p}` does not exist in the repository")
            elif p.startswith("configs/") and p.endswith(".yaml"):
                try:
                    config.load_config(os.path.join(REPO, p))
                except config.ConfigError as e:
                    out.append(f"`{p}` does not load: {e}")
    return out


def problems(text: str, doc_dir: str = REPO) -> list:
    """Every problem of one Markdown document (doc_dir: where its relative links start)."""
    found = []
    for lang, body in FENCE.findall(text):
        body = body.replace("\\\n", " ")
        if lang in ("", "bash", "sh", "shell", "console"):
            for line in body.splitlines():
                found += command_problems(line) + key_problems(line)
        found += path_problems(body)
    prose = ON_PURPOSE.sub("", FENCE.sub("", text))
    for span in INLINE.findall(prose):
        if span.startswith("--"):
            flag = FLAG.match(span).group(0)
            if flag not in all_flags():
                found.append(f"`{flag}` is a flag of no dflash-fast command, train.py or script")
        found += command_problems(span) + key_problems(span) + path_problems(span)
    for link in LINK.findall(prose):
        target, _, anchor = link.partition("#")
        if re.match(r"^[a-z]+:", target):
            continue
        path = os.path.join(doc_dir, target)
        if target and not os.path.realpath(path).startswith(os.path.realpath(REPO) + os.sep):
            found.append(f"link target `{target}` is outside the repository: a clone cannot follow it")
        elif target and not os.path.exists(path):
            found.append(f"link target `{target}` does not exist")
        elif anchor and (not target or target.endswith(".md")):
            page = open(path, encoding="utf-8").read() if target else text
            if anchor not in heading_anchors(page):
                found.append(f"link `{link}`: no heading of {target or 'this page'} has the anchor `#{anchor}`")
    return found


def heading_anchors(text: str) -> set:
    """The anchors GitHub gives a page's headings: lower case, punctuation but - and _ dropped, spaces -> -."""
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*$", FENCE.sub("", text), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("doc", DOC_FILES)
def test_docs_name_only_commands_flags_keys_and_paths_that_exist(doc):
    path = os.path.join(REPO, doc)
    found = problems(open(path, encoding="utf-8").read(), os.path.dirname(path))
    assert not found, f"{doc}:\n" + "\n".join(found)


def test_readme_first_commands_are_the_ones_ci_runs():
    """.ci/run installs as the README's first command does and runs its second: the README must open with them."""
    bash = [body.strip() for lang, body in FENCE.findall(open(os.path.join(REPO, "README.md")).read())
            if lang == "bash"]
    assert bash[:2] == [
        'python -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e ".[test]" '
        "&& dflash-fast quickstart",
        ". .venv/bin/activate && python -m pytest -q tests",
    ]
    ci = open(os.path.join(REPO, ".ci", "run")).read()
    assert 'pip install -q torch==2.13.0 -e ".[test]"' in ci and "python -m pytest -q tests" in ci


BAD = """
```bash
dflash-fast extract --target t --data d --out o --made-up-flag 3
dflash-fast frobnicate --out o
python train.py --config configs/tiny.yaml optimizer.lrr=3e-4 --resume
dflash-fast quickstart --out o loss.nosuch=1
python scripts/compare_recipes.py --out o --bogus-seeds 0
python train.py --config configs/nothere.yaml
```

Inline: `--no-such-flag`, `schedule.epochz`, `deepspeed train.py --config configs/tiny.yaml --resumee`, a
[broken link](nowhere.md), `bench/bench_nothing.py`, [a lost section](docs/training.md#no-such-section).
"""


def test_made_up_flags_keys_commands_and_paths_are_each_reported():
    found = "\n".join(problems(BAD))
    for name in ("--made-up-flag", "frobnicate", "optimizer.lrr", "loss.nosuch", "--bogus-seeds",
                 "configs/nothere.yaml", "--no-such-flag", "schedule.epochz", "--resumee", "nowhere.md",
                 "bench/bench_nothing.py", "#no-such-section"):
        assert name in found, f"{name} not reported:\n{found}"


def test_real_commands_keys_and_paths_pass():
    good = """
```bash
dflash-fast extract --target t --data d --out o [--dtype bf16|fp8] --estimate   # a comment --not-checked
deepspeed --num_gpus 8 train.py --config configs/qwen3-8b.yaml data.store=s deepspeed=configs/ds_zero{1,2,3}.json
dflash-fast quickstart --online loss.weighting=decay optimizer.kind=adamw
python scripts/compare_recipes.py --out o --seeds 0,1,2 --dtype fp8
```
`data.online.dtype`, `loss.png`, `--estimate`, `dflash-fast plot RUN`, [the index](docs/README.md),
[a section](docs/training.md#the-loss-and-its-position-weights), `deepspeed train.py --config FILE [KEY=VALUE ...]`.
| `python train.py optimizer.lrr=1` | `error: unknown config key 'optimizer.lrr'` | <!-- wrong on purpose -->
"""
    assert problems(good) == []


def test_recipes_json_holds_the_numbers_of_the_recipes_page():
    """docs/img/recipes.png is drawn from docs/recipes.json, whose numbers are copied from docs/recipes.md's tables:
    each summary must appear there as the table writes it, each per-seed value as the text writes it."""
    page = open(os.path.join(REPO, "docs", "recipes.md"), encoding="utf-8").read()
    data = json.load(open(os.path.join(REPO, "docs", "recipes.json")))
    for panel in data["panels"]:
        for arm, values in panel["arms"].items():
            for metric in ("tau", "tau_offline"):
                v = values[metric]
                if isinstance(v, dict):
                    cell = f"{v['mean']:.3f} ± {v['std']:.3f} ({v['min']:.3f}–{v['max']:.3f})"
                    assert f"| {arm} | 0, 1, 2 | " in page and cell in page, (arm, metric, cell)
                else:
                    for x in v:
                        assert re.search(rf"(?<![\d.]){re.escape(str(x))}(?!\d)", page), (arm, metric, x)


def test_every_figure_under_docs_is_shown_by_a_page_and_small():
    pages = "".join(open(os.path.join(REPO, d), encoding="utf-8").read() for d in DOC_FILES)
    for png in glob.glob(os.path.join(REPO, "docs", "img", "**", "*.png"), recursive=True):
        name = os.path.relpath(png, os.path.join(REPO, "docs"))
        assert f"({name})" in pages or f"(docs/{name})" in pages, f"docs/{name} is shown by no page"
        assert os.path.getsize(png) < 150_000, f"docs/{name} is {os.path.getsize(png)} bytes: keep figures < 150 KB"


def test_the_docs_index_lists_every_page():
    index = open(os.path.join(REPO, "docs", "README.md"), encoding="utf-8").read()
    for doc in DOC_FILES:
        name = os.path.basename(doc)
        if doc.startswith("docs") and name != "README.md":
            assert f"]({name})" in index, f"docs/README.md does not list {doc}: add a row for it"


# ---------------------------------------------------------------- citations of the semantics (docs/spec.md)
SPEC_SECTIONS = frozenset(int(n) for n in re.findall(r"^## (\d+)\. ", open(os.path.join(REPO, "docs", "spec.md"),
                                                                             encoding="utf-8").read(), re.M))
SPEC_CITATION = re.compile(r"spec\.md\s+((?:§\d+(?:-\d+)?(?:,\s*)?)+)")
# The semantics lived outside the repository once: each way it was cited then (scripts/cite_spec.py rewrites them).
OUTSIDE_SPEC = re.compile(r"\bSPEC(?:\.md)?\s+§|\bSPEC\.md\b|shared/SPEC|\bSPEC's\b|/work/shared/")


def citation_problems(text: str) -> list:
    """Citations of the semantics that a clone cannot follow: an outside path or name, or a § docs/spec.md lacks."""
    found = [f"`{m.group(0)}` cites the semantics outside the repository: cite docs/spec.md (scripts/cite_spec.py)"
             for m in OUTSIDE_SPEC.finditer(text)]
    for m in SPEC_CITATION.finditer(text):
        for first, last in re.findall(r"§(\d+)(?:-(\d+))?", m.group(1)):
            missing = [n for n in range(int(first), int(last or first) + 1) if n not in SPEC_SECTIONS]
            if missing:
                found.append(f"`{m.group(0).strip()}` cites §{missing[0]}, which docs/spec.md does not have")
    return found


def tracked_text_files() -> list:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True).stdout.decode()
    return [p for p in out.split("\0") if p and p not in ("docs/spec.md", "scripts/cite_spec.py", "tests/test_docs.py")
            and p.endswith((".py", ".md", ".yaml", ".yml", ".json", ".toml", ".sh", ".txt", ".cfg"))
            and os.path.isfile(os.path.join(REPO, p))]


def test_every_citation_of_the_semantics_is_docs_spec_md_and_a_section_it_has():
    found = []
    for path in tracked_text_files():
        try:
            text = open(os.path.join(REPO, path), encoding="utf-8").read()
        except UnicodeDecodeError:
            continue
        found += [f"{path}: {problem}" for problem in citation_problems(text)]
    assert not found, "\n".join(found)


def test_an_outside_citation_or_a_missing_section_is_reported():
    bad = ("as SPEC §5 says; see ../shared/SPEC.md and SPEC.md §1-2; (the SPEC's loops); spec.md §4, §99; "
           "spec.md §1-42")
    found = "\n".join(citation_problems(bad))
    for name in ("SPEC §", "shared/SPEC", "SPEC.md", "SPEC's", "§99", "spec.md §1-42"):
        assert name in found, f"{name} not reported:\n{found}"
    assert citation_problems("spec.md §1-2, §5 and spec.md §10") == []
    assert "outside the repository" in "\n".join(problems("[the semantics](../../shared/SPEC.md)", REPO))
