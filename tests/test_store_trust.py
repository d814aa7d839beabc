"""A store is read as data, never as directions: shard names stay inside it, each shard counts once, every field
of its JSON has the declared type, and `verify` hashes every byte of every file."""
import hashlib
import os
import shutil

import pytest
from test_store import _zero_bytes_in_place, edited_json, write_store

from dflash_fast import cli
from dflash_fast.store.format import INDEX, MANIFEST, Layout, sha256_file
from dflash_fast.store.reader import HiddenStateStore, verify_store

SHARD1 = "rank00000-shard00001"


def _opened_and_verified(path):
    """What a user sees: the reader's refusal, or verify's problems (for stores the reader opens)."""
    HiddenStateStore(path)
    return verify_store(path)


def _point_shard_1_at(store, name):
    """Hand-edit the manifest so that shards[1] is `name` (its recorded index sum follows, as a forger's would)."""
    target = os.path.join(store, "shards", name)
    with edited_json(store / MANIFEST) as manifest:
        manifest["shards"][1]["name"] = name
        manifest["shards"][1]["index_sha256"] = sha256_file(os.path.join(target, INDEX))


@pytest.mark.parametrize("how", ["parent", "absolute", "nested", "tmp"])
def test_a_shard_name_from_the_manifest_never_leads_outside_the_store(tmp_path, how):
    store, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    write_store(store)
    write_store(elsewhere, seed=1)  # a complete, valid shard of the same sizes: only the name can give it away
    name = {
        "parent": f"../../elsewhere/shards/{SHARD1}",
        "absolute": str(elsewhere / "shards" / SHARD1),
        "nested": f"{SHARD1}/.",
        "tmp": SHARD1 + ".tmp",
    }[how]
    if how == "tmp":
        shutil.copytree(elsewhere / "shards" / SHARD1, store / "shards" / name)
    _point_shard_1_at(store, name)
    with pytest.raises(ValueError, match=r"manifest.json: shards\[1\].name .* is not the name of a shard directory"):
        _opened_and_verified(store)
    assert cli.main(["verify", str(store)]) == 1


def test_a_shard_listed_twice_or_twice_through_a_symlink_is_refused(tmp_path):
    write_store(tmp_path)
    with edited_json(tmp_path / MANIFEST) as manifest:
        manifest["shards"].append(dict(manifest["shards"][1]))  # the totals follow: every count adds up
        manifest["num_sequences"] += manifest["shards"][1]["num_sequences"]
        manifest["num_tokens"] += manifest["shards"][1]["num_tokens"]
    with pytest.raises(ValueError, match=r"shards\[2\] \(rank00000-shard00001\) is the shard directory of "
                                         r"shards\[1\] again"):
        _opened_and_verified(tmp_path)
    os.symlink(SHARD1, tmp_path / "shards" / "alias")
    with edited_json(tmp_path / MANIFEST) as manifest:
        manifest["shards"][2]["name"] = "alias"
    with pytest.raises(ValueError, match=r"shards\[2\] \(alias\) is the shard directory of shards\[1\] again"):
        _opened_and_verified(tmp_path)


def test_a_shard_directory_symlinked_to_another_disk_stays_readable(tmp_path):
    """The documented exception: the name stays inside the store, the directory it names may live elsewhere."""
    items = write_store(tmp_path / "store")
    shutil.move(tmp_path / "store" / "shards" / SHARD1, tmp_path / "disk2")
    os.symlink(tmp_path / "disk2", tmp_path / "store" / "shards" / SHARD1)
    assert _opened_and_verified(tmp_path / "store") == []
    assert HiddenStateStore(tmp_path / "store")[4]["input_ids"].tolist() == items[4]["input_ids"].tolist()


def _set(data, path, value):
    *parents, last = path
    for key in parents:
        data = data[key]
    if value is KeyError:
        del data[last]
    else:
        data[last] = value


INDEX1 = f"shards/{SHARD1}/{INDEX}"


@pytest.mark.parametrize("file, path, value, message", [
    (MANIFEST, ["shards"], SHARD1, 'shards must be a list of objects, got "rank00000-shard00001"'),
    (MANIFEST, ["shards", 1, "name"], KeyError, r"shards\[1\].name is missing \(it must be a string\)"),
    (MANIFEST, ["shards", 1, "name"], 1, r"shards\[1\].name must be a string, got 1"),
    (MANIFEST, ["layer_ids"], 3, "layer_ids must be a list of non-negative integers, got 3"),
    (MANIFEST, ["shards", 1, "num_tokens"], "5", r'shards\[1\].num_tokens must be a non-negative integer, got "5"'),
    (MANIFEST, ["hidden_size"], 16.0, "hidden_size must be a positive integer, got 16.0"),
    (MANIFEST, ["has_last"], "yes", 'has_last must be true or false, got "yes"'),
    (MANIFEST, ["extraction"], [], "extraction must be an object, got a list"),
    (INDEX1, ["lengths"], ["4", "1"], r'lengths\[0\] must be a non-negative integer, got "4"'),
    (INDEX1, ["lengths"], [6, -1], r"lengths\[1\] must be a non-negative integer, got -1"),
    (INDEX1, ["files"], [], "files must be an object, got a list"),
    (INDEX1, ["files", "hidden", "shape"], "[5, 3, 16]", r'files.hidden.shape must be a list of non-negative'),
])
def test_a_store_json_field_of_the_wrong_type_is_one_error_naming_the_file_and_the_field(
        tmp_path, capsys, file, path, value, message):
    write_store(tmp_path)
    with edited_json(tmp_path / file) as data:
        _set(data, path, value)
    if file == INDEX1:  # the manifest vouches for the edited index, as a forger's would
        with edited_json(tmp_path / MANIFEST) as manifest:
            manifest["shards"][1]["index_sha256"] = sha256_file(tmp_path / INDEX1)
    with pytest.raises(ValueError, match=f"{tmp_path / file}: {message}"):
        _opened_and_verified(tmp_path)
    assert cli.main(["verify", str(tmp_path)]) == 1
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / file}: ")


@pytest.mark.parametrize("file", [MANIFEST, INDEX1])
def test_a_store_json_nested_too_deeply_to_parse_is_one_error(tmp_path, file):
    write_store(tmp_path)
    (tmp_path / file).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=f"{tmp_path / file} is not valid JSON: it is nested too deeply"):
        HiddenStateStore(tmp_path)


# ---------------------------------------------------------------- checksums reach every byte


def test_sha256_file_hashes_every_byte_of_a_multi_mib_file(tmp_path):
    data = os.urandom(3 * 2**20 + 123)  # several of the helper's 1 MiB reads and a partial one
    (tmp_path / "f").write_bytes(data)
    assert sha256_file(tmp_path / "f") == hashlib.sha256(data).hexdigest()


def test_verify_finds_a_shard_byte_changed_past_the_first_mib(tmp_path):
    layout = Layout(num_tapped=4, hidden_size=512, topk=4, dtype="float32", has_last=False)  # 8 KiB a token
    write_store(tmp_path, layout=layout, lengths=[[200, 110]])
    hidden = tmp_path / "shards" / "rank00000-shard00000" / "hidden.bin"
    assert os.path.getsize(hidden) > 2 * 2**20
    assert verify_store(tmp_path) == []
    _zero_bytes_in_place(hidden, 2 * 2**20 + 40, 4)
    (problem,) = verify_store(tmp_path)
    assert problem.startswith(f"{hidden}: sha256 ")


def test_a_ranks_note_of_the_wrong_shape_is_one_error_naming_the_file_and_the_field(tmp_path):
    from dflash_fast.extract.extract import RANKS_DIR, _wait_for_ranks

    (tmp_path / RANKS_DIR).mkdir()
    note = tmp_path / RANKS_DIR / "rank00000.json"
    note.write_text('{"job": "j", "shards": "rank00000-shard00000", "input": {}, "run": {}}')
    with pytest.raises(ValueError, match=f'{note}: shards must be a list of objects, got "rank00000-shard00000"'):
        _wait_for_ranks(str(tmp_path), 1, "j")
