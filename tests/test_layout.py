"""docs/layout.md's import order holds in the code: no dflash_fast module imports one after it in the pipeline
(issue 26: split by idea, imports follow the pipeline, no circle). Lazy imports inside functions count too."""
import ast
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "dflash_fast")


def pipeline_floors() -> dict:
    """module -> its floor in layout.md's `Imports follow the pipeline: a -> b / c -> ...` sentence."""
    with open(os.path.join(REPO, "docs", "layout.md")) as f:
        text = f.read()
    found = re.search(r"Imports follow the pipeline: (.*?); no module imports one after it", text, re.S)
    assert found, "docs/layout.md no longer states the import order"
    floors = [floor.split("/") for floor in " ".join(found.group(1).split()).split("->")]
    return {name.strip(): i for i, floor in enumerate(floors) for name in floor}


def dflash_imports(source: str) -> set:
    """The dflash_fast modules `source` imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dflash_fast."):
            names.add(node.module.split(".")[1])
        elif isinstance(node, ast.ImportFrom) and node.module == "dflash_fast":
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {alias.name.split(".")[1] for alias in node.names if alias.name.startswith("dflash_fast.")}
    return names


def upward_imports(floor: dict, sources: dict) -> list:
    return [f"{module} imports {other}, which comes after it"
            for module, source in sorted(sources.items()) if module in floor
            for other in sorted(dflash_imports(source)) if other in floor and floor[other] > floor[module]]


def package_sources() -> dict:
    sources = {}
    for name in os.listdir(PACKAGE):
        if name.endswith(".py"):
            with open(os.path.join(PACKAGE, name)) as f:
                sources[name[:-3]] = f.read()
    return sources


def test_every_module_the_import_order_names_exists():
    sources = package_sources()
    assert sorted(set(pipeline_floors()) - set(sources)) == []


def test_no_module_imports_one_after_it_in_the_pipeline():
    assert upward_imports(pipeline_floors(), package_sources()) == []


def test_an_import_back_up_the_pipeline_is_reported():
    floor = pipeline_floors()
    sources = dict(package_sources(), weights="def f():\n    from dflash_fast.drafter import DFlashDrafter\n")
    assert upward_imports(floor, sources) == ["weights imports drafter, which comes after it"]
