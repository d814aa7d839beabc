"""docs/layout.md tells where each stage lives and in which order the modules may import each other; the code
cannot drift from it: every module of dflash_fast/ is listed, and no module imports one the pipeline line puts
after it (module-level and function-level imports alike)."""
import ast
import glob
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUT = open(os.path.join(REPO, "docs", "layout.md")).read()
MODULES = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(REPO, "dflash_fast", "*.py"))
                 if not p.endswith("__init__.py"))


def pipeline_floors(text: str) -> dict:
    """module -> its floor in the 'Imports follow the pipeline: a / b -> c -> ...;' sentence."""
    line = " ".join(re.search(r"Imports follow the pipeline:(.*?);", text, re.S).group(1).split())
    return {name.strip(): floor for floor, names in enumerate(line.split("->")) for name in names.split("/")}


def imported_modules(module: str) -> set:
    """The dflash_fast modules `module` imports, wherever the import statement sits."""
    tree = ast.parse(open(os.path.join(REPO, "dflash_fast", module + ".py")).read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "dflash_fast":
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dflash_fast."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("dflash_fast."))
    return found - {module}


def upward_imports(floors: dict, imports_of) -> list:
    """'a imports b' for each module a of the pipeline that imports a module b on a later floor."""
    return [f"{m} imports {d}" for m in floors for d in sorted(imports_of(m)) if d in floors and floors[d] > floors[m]]


def test_layout_md_lists_every_module():
    listed = set(re.findall(r"\b([a-z_0-9]+)\.py\b", LAYOUT))
    assert [m for m in MODULES if m not in listed] == [], "add these modules to docs/layout.md's list"


def test_imports_follow_the_pipeline_order_layout_md_states():
    floors = pipeline_floors(LAYOUT)
    assert set(floors) <= set(MODULES), f"the pipeline line names no such modules: {set(floors) - set(MODULES)}"
    assert upward_imports(floors, imported_modules) == [], "imports that point back up the pipeline (docs/layout.md)"


def test_an_import_back_up_the_pipeline_is_reported():
    floors = pipeline_floors("Imports follow the pipeline: store -> target / extract ->\n trainer; no module ...")
    assert floors == {"store": 0, "target": 1, "extract": 1, "trainer": 2}
    imports = {"store": {"errors"}, "target": {"store", "extract"}, "extract": {"trainer"}, "trainer": {"store"}}
    assert upward_imports(floors, imports.get) == ["extract imports trainer"]
