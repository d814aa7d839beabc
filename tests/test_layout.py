"""docs/layout.md tells where each stage lives and in which order the stage packages may import each other; the code
cannot drift from it: every module of dflash_fast/ is listed, every package stands on the pipeline line, no module
imports one in a package the line puts after its own, and no import circle exists between modules — module-level and
function-level (lazy) imports alike, inside a package too (two modules of one floor once imported each other:
plan <-> vllm_extract, evaluate <-> vllm_engine <-> regenerate, both lazy on one side)."""
import ast
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIRS = {"dflash_fast": os.path.join(REPO, "dflash_fast"), "dflash_fast.kernels": os.path.join(REPO, "kernels")}
LAYOUT = open(os.path.join(REPO, "docs", "layout.md")).read()


def modules() -> dict:
    """dotted module name -> file, for every module installed under dflash_fast (kernels/ is dflash_fast.kernels)."""
    found = {}
    for package, root in PACKAGE_DIRS.items():
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d not in ("assets", "__pycache__")]
            if root == PACKAGE_DIRS["dflash_fast"] and os.path.abspath(folder) == root:
                dirs[:] = [d for d in dirs if os.path.join(root, d) != PACKAGE_DIRS["dflash_fast.kernels"]]
            rel = os.path.relpath(folder, root)
            prefix = package if rel == "." else package + "." + rel.replace(os.sep, ".")
            for f in files:
                if f.endswith(".py"):
                    found[prefix if f == "__init__.py" else f"{prefix}.{f[:-3]}"] = os.path.join(folder, f)
    return found


MODULES = modules()


IMPORT_CALLS = ("import_module", "__import__")


def dynamic_imports(tree: ast.AST) -> set:
    """The modules a module loads by name at run time: `importlib.import_module("dflash_fast.x")` and
    `__import__(...)` with a literal name, or an f-string (`f"dflash_fast.kernels.{op}"`: every module whose
    name fits, each formatted part standing for any text). A call whose name is neither (a variable, a table
    lookup such as cli's `COMMANDS[name][0]`) counts every module name written as a string literal in the
    module, since that is where such a table spells them."""
    found, opaque = set(), False
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args and getattr(node.func, "attr", getattr(node.func, "id", None))
                in IMPORT_CALLS):
            continue
        arg = node.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            found.add(arg.value)
        elif isinstance(arg, ast.JoinedStr):
            pattern = "".join(re.escape(part.value) if isinstance(part, ast.Constant) else ".+"
                              for part in arg.values)
            found.update(m for m in MODULES if re.fullmatch(pattern, m))
        else:
            opaque = True
    if opaque:
        found.update(node.value for node in ast.walk(tree)
                     if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in MODULES)
    return found


def imports_of(source: str, importer: str) -> set:
    """The dflash_fast modules `source` (the text of module `importer`) imports, wherever the statement sits,
    the ones it loads through importlib included (`dynamic_imports`)."""
    tree = ast.parse(source)
    found = dynamic_imports(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dflash_fast"):
            for a in node.names:  # `from dflash_fast.store import format` names a module; `import X` a name
                found.add(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("dflash_fast"))
    return {m for m in found if m in MODULES} - {importer}


def import_graph() -> dict:
    return {m: imports_of(open(path).read(), m) for m, path in MODULES.items()}


def floor_of(module: str, floors: dict):
    """A module's floor: its stage package's (dflash_fast.store.format -> store), a top-level module's own name."""
    parts = module.split(".")
    return floors.get(parts[1] if len(parts) > 1 else "__init__")


def pipeline_floors(text: str) -> dict:
    """package -> its floor in the 'Imports follow the pipeline: a / b -> c -> ...;' sentence."""
    line = " ".join(re.search(r"Imports follow the pipeline:(.*?);", text, re.S).group(1).split())
    return {name.strip(): floor for floor, names in enumerate(line.split("->")) for name in names.split("/")}


def upward_imports(graph: dict, floors: dict) -> list:
    """'a imports b' for each module a that imports a module b on a later floor."""
    return [f"{m} imports {d}" for m in sorted(graph) for d in sorted(graph[m])
            if floor_of(d, floors) > floor_of(m, floors)]


def circles(graph: dict) -> list:
    """Each import circle once, as [a, b, ..., a] (the strongly connected components of more than one module)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component) + [sorted(component)[0]])

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def listed_modules(text: str) -> set:
    """The modules docs/layout.md's tree lists: `  name.py` at the top of dflash_fast/, `    name.py` under
    `  package/`, `      name.py` under its `    subpackage/`, and the kernels/ files named on its line."""
    found, package, sub = set(), None, None
    for line in text.splitlines():
        if m := re.match(r"^  ([a-z_]+)/\s", line):
            package = m.group(1)
        elif m := re.match(r"^    ([a-z_]+)/\s", line):
            sub = m.group(1)
        elif m := re.match(r"^      ([a-z_0-9]+)\.py\b", line):
            found.add(f"dflash_fast.{package}.{sub}.{m.group(1)}")
        elif m := re.match(r"^    ([a-z_0-9]+)\.py\b", line):
            found.add(f"dflash_fast.{package}.{m.group(1)}")
        elif m := re.match(r"^  ([a-z_0-9]+)\.py\b", line):
            found.add(f"dflash_fast.{m.group(1)}")
        elif line.startswith("kernels/") or (line.startswith(" " * 20) and package == "kernels"):
            package = "kernels"
            found.update(f"dflash_fast.kernels.{n}" for n in re.findall(r"\b([a-z_0-9]+)\.py\b", line))
        elif re.match(r"^[a-z]", line):
            package = None
    return found


def test_layout_md_lists_every_module():
    listed = listed_modules(LAYOUT)
    assert sorted(m for m, path in MODULES.items() if m not in listed and not path.endswith("__init__.py")) == [], \
        "add these modules to docs/layout.md's tree, under their package"


def test_every_stage_package_is_on_the_pipeline_line_and_documents_what_it_holds():
    floors = pipeline_floors(LAYOUT)
    packages = {m.split(".")[1] for m in MODULES if "." in m}  # the stage packages and the top-level modules
    assert sorted(p for p in packages if p not in floors) == [], "put these on docs/layout.md's pipeline line"
    for m, path in MODULES.items():
        if path.endswith("__init__.py") and m != "dflash_fast":
            assert ast.get_docstring(ast.parse(open(path).read())), f"{m}: say in a docstring what the package holds"


def test_imports_follow_the_pipeline_order_layout_md_states():
    floors = pipeline_floors(LAYOUT)
    assert upward_imports(import_graph(), floors) == [], "imports that point back up the pipeline (docs/layout.md)"


def test_no_import_circle_lazy_imports_included():
    assert circles(import_graph()) == []


def test_an_import_back_up_the_pipeline_is_reported():
    floors = pipeline_floors("Imports follow the pipeline: store -> target / extract ->\n train; no module ...")
    assert floors == {"store": 0, "target": 1, "extract": 1, "train": 2}
    graph = import_graph()
    lazy = "def f():\n    from dflash_fast.train.trainer import Trainer\n"
    graph["dflash_fast.store.reader"] = imports_of(open(MODULES["dflash_fast.store.reader"]).read() + lazy,
                                                   "dflash_fast.store.reader")
    assert "dflash_fast.store.reader imports dflash_fast.train.trainer" in upward_imports(
        graph, pipeline_floors(LAYOUT))


def test_a_circle_through_a_lazy_import_is_reported():
    graph = import_graph()
    # plan's old lazy import of the vLLM runner, which imports plan back: a circle inside one package
    lazy = "def make():\n    from dflash_fast.extract.vllm_runner import VllmRunner\n"
    graph["dflash_fast.extract.plan"] = imports_of(open(MODULES["dflash_fast.extract.plan"]).read() + lazy,
                                                   "dflash_fast.extract.plan")
    assert ["dflash_fast.extract.plan", "dflash_fast.extract.vllm_runner", "dflash_fast.extract.plan"] in circles(graph)
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_an_import_through_importlib_is_an_import():
    """A module loaded by name is an edge of the graph like an import statement: a literal name, an f-string, and
    a table of names read by a computed lookup (cli.COMMANDS) are each seen, and one that climbs is reported."""
    graph = import_graph()
    assert "dflash_fast.kernels.lm_head_loss" in graph["dflash_fast.drafter.ops"]  # f"dflash_fast.kernels.{op}"
    assert "dflash_fast.evaluate.quickstart" in graph["dflash_fast.cli"]  # COMMANDS[name][0]
    floors = pipeline_floors(LAYOUT)
    for call in ('importlib.import_module("dflash_fast.train.trainer")',
                 'importlib.import_module(f"dflash_fast.train.{name}")',
                 'importlib.import_module(NAMES[k])\nNAMES = {"t": "dflash_fast.train.trainer"}'):
        source = open(MODULES["dflash_fast.store.reader"]).read() + f"\ndef f(name, k):\n    {call}\n"
        graph["dflash_fast.store.reader"] = imports_of(source, "dflash_fast.store.reader")
        assert "dflash_fast.store.reader imports dflash_fast.train.trainer" in upward_imports(graph, floors), call
    # the loop the kernels once closed: the loss vocabulary loading a kernel by name, which imports it back
    graph = import_graph()
    lazy = "def f(op):\n    return importlib.import_module(f'dflash_fast.kernels.{op}')\n"
    graph["dflash_fast.drafter.losses"] = imports_of(open(MODULES["dflash_fast.drafter.losses"]).read() + lazy,
                                                     "dflash_fast.drafter.losses")
    assert any("dflash_fast.drafter.losses" in c and "dflash_fast.kernels.lm_head_loss" in c for c in circles(graph))


# The attributes only a drafter family's own module may touch (its modules, named as the engines name them).
# (DSpark's confidence_head is also the name of its option, read from configs everywhere, so it is not among them.)
FAMILY_ATTRIBUTES = {"markov_head", "candidate_selector", "dspark_heads", "selector_walk"}
FAMILY_MODULES = {"dflash_fast.drafter.dspark", "dflash_fast.drafter.dflash2"}


def family_attribute_uses(source: str) -> set:
    return {node.attr for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr in FAMILY_ATTRIBUTES}


def test_no_module_but_a_familys_own_reaches_into_its_modules():
    """Each family has one home: outside its module nothing reads its heads or calls its walk (the backbone calls
    the family hooks; the export names the parameters by their strings)."""
    found = {m: sorted(family_attribute_uses(open(path).read())) for m, path in MODULES.items()
             if m not in FAMILY_MODULES}
    assert {m: uses for m, uses in found.items() if uses} == {}
    assert family_attribute_uses("def f(d):\n    return d.candidate_selector.top_k\n") == {"candidate_selector"}


# Where a family's name may be spelled (docs/contributing.md, "A drafter family"): its two homes, the drafter's and
# the serving side's, and these three, each for a reason of its own.
NAMING_MODULES = {
    "dflash_fast.drafter.config": "its options' DrafterConfig.family case",
    "dflash_fast.drafter.families": "the one list of the families",
    "dflash_fast.evaluate.quickstart": "the quickstart's recipe of the family, when it has one (a YAML under configs/)",
}


def family_spellings() -> dict:
    """Every family's name and the architectures its serving home gives it -> the family (DFlash, the backbone and
    every engine's default, aside: its name is also vLLM's method and its architecture every plain export's)."""
    from dflash_fast.serve.families import LAYOUTS

    return {spelled: name for name, layout in LAYOUTS.items() if name != "dflash"
            for spelled in (name, layout.speculators_architecture, layout.zlab_architecture) if spelled}


def names_spelled(source: str, spellings: dict) -> set:
    """The families whose name (or architecture) `source` writes as a whole string, docstrings aside."""
    tree = ast.parse(source)
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return {spellings[node.value] for node in ast.walk(tree) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and node.value in spellings and id(node) not in docs}


def test_no_module_outside_a_familys_homes_branches_on_its_name():
    """One home per family, on each side of the pipeline: dflash_fast/drafter/<family>.py (the model, its loss terms
    and walk) and dflash_fast/serve/families/<family>.py (its layouts, the engines' readings, what serves it). Every
    other module asks DrafterConfig.family and the homes' hooks, so it never spells a family's name or architecture
    (as LiLiCorr's export once did in model_card.py, engines.py and evaluate/vllm.py)."""
    spellings = family_spellings()
    assert set(spellings.values()) == {"dspark", "dflash2", "lilicorr"}
    found = {}
    for m, path in MODULES.items():
        named = names_spelled(open(path).read(), spellings)
        homes = {f for f in named if m in (f"dflash_fast.drafter.{f}", f"dflash_fast.serve.families.{f}")}
        if named - homes and m not in NAMING_MODULES:
            found[m] = sorted(named - homes)
    assert found == {}
    # the check can fail: a branch on a name, or an architecture's, in a module outside the homes
    for line in ('if cfg.family == "lilicorr":\n    pass\n',
                 'LILICORR = ("vllm",) if x == "LiLiCorrDraftModel" else ()\n'):
        source = open(MODULES["dflash_fast.serve.model_card"]).read() + "\n" + line
        assert names_spelled(source, spellings) == {"lilicorr"}, line
