"""scripts/mutation_check.py still applies to the code as it is: every target line exists exactly once, every
mutant parses and differs from it, every test it names exists. (Running the mutations is not CI's job: see
docs/testing.md.)"""
import ast
import importlib.util
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("mutation_check", os.path.join(REPO, "scripts", "mutation_check.py"))
mutation_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mutation_check)
MUTATIONS = mutation_check.MUTATIONS


def test_mutation_names_are_unique():
    names = [m.name for m in MUTATIONS]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_mutation_applies_to_exactly_one_line_and_parses(mutation):
    with open(os.path.join(REPO, mutation.path)) as f:
        text = f.read()
    mutated = mutation_check.mutate(text, mutation)  # raises unless the target line occurs exactly once
    assert mutated != text and len(mutated.splitlines()) >= len(text.splitlines()) - 1
    ast.parse(mutated, filename=mutation.path)


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_mutation_tests_exist(mutation):
    assert mutation.tests
    for node in mutation.tests:
        path, _, name = node.partition("::")
        with open(os.path.join(REPO, path)) as f:
            source = f.read()
        if name:
            assert re.search(rf"^def {re.escape(name.split('[')[0])}\(", source, re.M), f"{node}: no such test"


def test_a_target_line_that_moved_on_is_reported_by_name():
    missing = mutation_check.Mutation("gone", "dflash_fast/drafter/model.py", "this line is not there", None, ["x"], "")
    with pytest.raises(ValueError, match="gone: the line 'this line is not there' occurs 0 times"):
        mutation_check.mutate("a = 1\n", missing)
