"""Every JSON file the project reads has a declared shape: a field of the wrong type, a missing field or a nesting
too deep to parse is one error naming the file and the field, never a traceback far from the cause."""
import json
import os

import pytest
from test_store import _zero_bytes_in_place

from dflash_fast.errors import COUNT, STR, ListOf, MapOf, Obj, schema_problem
from dflash_fast.train.checkpoint import (
    MARKER,
    MARKER_FORMAT,
    CheckpointError,
    read_marker,
    select_checkpoint,
    verify_checkpoint,
    write_marker,
)


def test_schema_problem_names_the_first_wrong_field_by_its_path():
    schema = Obj({"shards": ListOf(Obj({"name": STR, "num_tokens": COUNT}))}, optional={"files": MapOf(COUNT)})
    good = {"shards": [{"name": "a", "num_tokens": 3}], "files": {"x": 1}, "extra": "kept"}
    assert schema_problem(good, schema) is None
    assert schema_problem({"shards": [{"name": "a", "num_tokens": 3}, {"name": "b", "num_tokens": "12"}]},
                          schema) == 'shards[1].num_tokens must be a non-negative integer, got "12"'
    assert schema_problem({"shards": [{"num_tokens": 1}]}, schema) == "shards[0].name is missing (it must be a string)"
    assert schema_problem({"shards": {}}, schema) == "shards must be a list of objects, got an object"
    assert schema_problem({"shards": [], "files": {"x": True}}, schema) == \
        "files.x must be a non-negative integer, got true"


def _checkpoint(tmp_path, size=100):
    ckpt = tmp_path / "step00000003"
    ckpt.mkdir()
    (ckpt / "drafter.safetensors").write_bytes(os.urandom(size))
    write_marker(str(ckpt), {"step": 3, "epoch": 0, "micro_batch": 12, "data": {}, "drafter": {}, "verifier": "t"})
    return ckpt


@pytest.mark.parametrize("path, value, field", [
    (["client", "step"], "3", 'client.step must be a non-negative integer, got "3"'),
    (["client", "data"], [], "client.data must be an object, got a list"),
    (["client"], [], "client must be an object, got a list"),
    (["files", "drafter.safetensors", "size"], -1, "files.drafter.safetensors.size must be a non-negative integer"),
    (["files"], ["drafter.safetensors"], "files must be an object, got a list"),
])
def test_a_marker_field_of_the_wrong_type_makes_an_incomplete_checkpoint_that_names_the_field(
        tmp_path, path, value, field):
    ckpt = _checkpoint(tmp_path)
    marker = json.loads((ckpt / MARKER).read_text())
    node = marker
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    (ckpt / MARKER).write_text(json.dumps(marker))
    got, why = read_marker(str(ckpt))
    assert got is None and f"not a {MARKER_FORMAT!r} completion marker ({field}" in why
    with pytest.raises(CheckpointError, match="does not verify"):
        select_checkpoint(str(ckpt))


def test_a_marker_nested_too_deeply_to_parse_is_an_incomplete_checkpoint(tmp_path):
    ckpt = _checkpoint(tmp_path)
    (ckpt / MARKER).write_text('{"client": ' + "[" * 100_000 + "]" * 100_000 + "}")
    got, why = read_marker(str(ckpt))
    assert got is None and "is unreadable" in why and "nested too deeply" in why


def test_verify_finds_a_checkpoint_byte_changed_past_the_first_mib(tmp_path):
    ckpt = _checkpoint(tmp_path, size=3 * 2**20 + 5)
    assert verify_checkpoint(str(ckpt)) == []
    _zero_bytes_in_place(ckpt / "drafter.safetensors", 2 * 2**20 + 7, 4)
    (problem,) = verify_checkpoint(str(ckpt))
    assert problem.startswith("drafter.safetensors: sha256 ") and "same size" in problem


def test_an_rng_state_of_the_wrong_shape_is_one_error_naming_the_field(tmp_path):
    from dflash_fast.train.checkpoint import restore_rng_state, rng_file

    (tmp_path / rng_file(0)).write_text('{"python": [3, [], null], "numpy": [], "torch": 5}')
    with pytest.raises(CheckpointError, match=f"{tmp_path / rng_file(0)}: torch must be a string, got 5"):
        restore_rng_state(str(tmp_path), 0)


@pytest.mark.parametrize("fmt, edit, message", [
    ("speculators", lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens="7"),
     r'speculators_config.proposal_methods\[0\].speculative_tokens must be an integer, got "7"'),
    ("zlab", lambda c: c.update(architectures="DFlashDraftModel"), 'architectures must be a list of strings'),
    ("zlab", lambda c: c["dflash_config"].update(use_swa="no"), 'dflash_config.use_swa must be true or false'),
])
def test_an_export_config_key_of_the_wrong_type_is_one_error_naming_its_path(tmp_path, fmt, edit, message):
    import torch
    from test_export import edit_config, make_drafter

    from dflash_fast.serve.export import export_drafter, load_exported
    from dflash_fast.serve.layouts import ExportError

    out = export_drafter(make_drafter(), str(tmp_path / "export"), "tiny-target", torch.float32, fmt=fmt)
    edit_config(out, edit)
    with pytest.raises(ExportError, match=f"{os.path.join(out, 'config.json')}: {message}"):
        load_exported(out)


@pytest.mark.parametrize("fmt, edit, message", [
    ("speculators", lambda c: c.update(mask_token_id=""), 'mask_token_id must be an integer, got ""'),
    ("speculators", lambda c: c.update(sample_from_anchor=0), "sample_from_anchor must be true or false, got 0"),
    ("speculators", lambda c: c.update(block_size=False), "block_size must be an integer, got false"),
    ("speculators", lambda c: c.update(speculators_config=[]), "speculators_config must be an object, got a list"),
    ("zlab", lambda c: c["dflash_config"].update(mask_token_id=[]), "dflash_config.mask_token_id must be an integer"),
    ("zlab", lambda c: c.update(layer_types=""), 'layer_types must be a list of strings, got ""'),
    ("zlab", lambda c: c.update(dflash_fast=0), "dflash_fast must be an object, got 0"),
])
def test_a_falsy_value_of_the_wrong_type_in_a_nullable_key_is_refused_not_read_as_null(tmp_path, fmt, edit, message):
    import torch
    from test_export import edit_config, make_drafter

    from dflash_fast.serve.export import export_drafter, load_exported
    from dflash_fast.serve.layouts import ExportError

    out = export_drafter(make_drafter(), str(tmp_path / "export"), "tiny-target", torch.float32, fmt=fmt)
    edit_config(out, edit)
    with pytest.raises(ExportError, match=f"{os.path.join(out, 'config.json')}: {message}"):
        load_exported(out)


@pytest.mark.parametrize("line, message", [
    ("[0, 1]", "the line must be an object, got a list: not a response of regenerate"),
    ('{"index": "0", "text": "hi"}', 'index must be a non-negative integer, got "0"'),
    ("[" * 100_000 + "]" * 100_000, "is not valid JSON"),
])
def test_a_regenerate_output_line_of_the_wrong_shape_is_one_error_naming_the_line(tmp_path, line, message):
    from dflash_fast.extract.regenerate import read_done
    from dflash_fast.target.prompts import read_prompts

    out = tmp_path / "out.jsonl"
    out.write_text('{"index": 0, "text": "hi there", "sampling": {}}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"{out}:2:? {message}"):
        read_done(str(out), read_prompts([{"text": "hi"}, {"text": "ho"}]), {})


def test_a_training_config_nested_too_deeply_to_parse_is_one_config_error(tmp_path):
    from dflash_fast.train.config import ConfigError, load_config

    (tmp_path / "run.yaml").write_text("data: " + "[" * 3000 + "]" * 3000 + "\n")
    with pytest.raises(ConfigError, match=f"{tmp_path / 'run.yaml'} is not valid YAML: it is nested too deeply"):
        load_config(str(tmp_path / "run.yaml"))


# ---------------------------------------------------------------- a target's own JSON (config.json, the index)


@pytest.mark.parametrize("weight_map, message", [([], "weight_map must be an object, got a list"),
                                                 ({"lm_head.weight": 3}, "weight_map.lm_head.weight must be a string")])
def test_a_target_index_of_the_wrong_shape_is_one_error_naming_the_field(tmp_path, weight_map, message):
    from dflash_fast.drafter.weights import target_tensor_files
    from dflash_fast.target.load import _safetensors_files

    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    for read in (target_tensor_files, _safetensors_files):
        with pytest.raises(ValueError, match=f"{index}: {message}"):
            read(str(tmp_path))


@pytest.mark.parametrize("text, message", [("[" * 100_000, "is not valid JSON"), ('{"text_config": []}',
                                           "text_config must be an object, got a list")])
def test_a_target_config_that_is_no_model_config_is_one_error_naming_the_file(tmp_path, text, message):
    from dflash_fast.drafter.weights import load_frozen_tensors

    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=f"{tmp_path / 'config.json'}:? {message}"):
        load_frozen_tensors(str(tmp_path))
