"""The on-disk store: layer-id convention, writer/reader round trip, refusals of damaged stores."""
import contextlib
import json
import os
import pickle

import numpy as np
import pytest
import torch

from dflash_fast import cli
from dflash_fast.store.format import DTYPES, INDEX, MANIFEST, Layout, write_json_atomic
from dflash_fast.store.fp8 import dequantize_fp8, quantize_fp8
from dflash_fast.store.layer_ids import check_layer_ids, default_layer_ids
from dflash_fast.store.reader import HiddenStateStore, verify_store
from dflash_fast.store.writer import StoreWriter
from dflash_fast.target.norm import final_norm_weight

LAYOUT = Layout(num_tapped=3, hidden_size=16, topk=4, dtype="bfloat16", has_last=True)
LENGTHS = [[5, 3, 7], [4, 1]]  # two shards


def _bits(t):
    """numpy array of a tensor's on-disk form: bf16 and fp8 as their uint16 / uint8 bits."""
    return t.view({torch.bfloat16: torch.uint16, torch.float8_e4m3fn: torch.uint8}.get(t.dtype, t.dtype)).numpy()


def _random_sequence(layout, n, rng):
    """Per-field arrays of one sequence in the on-disk dtypes; bf16 and fp8 as their bits, fp8 with scales."""
    torch_dtype = DTYPES[layout.dtype][1]
    hidden = torch.randn(n, layout.num_tapped, layout.hidden_size, generator=rng)
    last = torch.randn(n, layout.hidden_size, generator=rng)
    logits = torch.randn(n, layout.topk, generator=rng).sort(dim=-1, descending=True).values
    arrays = {
        "input_ids": torch.randint(0, 1000, (n,), generator=rng).to(torch.int32).numpy(),
        "loss_mask": (torch.rand(n, generator=rng) > 0.3).numpy(),
        "teacher_topk_ids": torch.randint(0, 1000, (n, layout.topk), generator=rng).to(torch.int32).numpy(),
        "teacher_topk_logits": logits.numpy(),
        "teacher_lse": torch.randn(n, generator=rng).numpy(),
    }
    for name, x in (("hidden", hidden), ("last", last)):
        if torch_dtype == torch.float8_e4m3fn:
            q, scale = quantize_fp8(x)
            arrays[name], arrays[f"{name}_scale"] = _bits(q), scale.numpy()
        else:
            arrays[name] = _bits(x.to(torch_dtype))
    if not layout.has_last:
        del arrays["last"]
        arrays.pop("last_scale", None)
    return arrays


def write_store(path, layout=LAYOUT, lengths=LENGTHS, seed=0):
    """Write a store of random data through StoreWriter; return the per-item arrays written."""
    rng = torch.Generator().manual_seed(seed)
    writer = StoreWriter(str(path), layout)
    items, shards = [], []
    for s, shard_lengths in enumerate(lengths):
        name = writer.shard_name(0, s)
        shard = writer.open_shard(name, shard_lengths, {"job": "test"})
        seqs = [_random_sequence(layout, n, rng) for n in shard_lengths]
        for i in reversed(range(len(seqs))):  # any order: each sequence lands at its own offset
            shard.write(i, seqs[i])
        shard.commit()
        items.extend(seqs)
        shards.append({"name": name, "num_sequences": len(shard_lengths), "num_tokens": sum(shard_lengths)})
    writer.write_manifest({
        "layer_ids": list(range(layout.num_tapped)),
        "hidden_size": layout.hidden_size,
        "topk": layout.topk,
        "dtype": layout.dtype,
        "has_last": layout.has_last,
        "num_sequences": sum(len(x) for x in lengths),
        "num_tokens": sum(sum(x) for x in lengths),
        "shards": shards,
    })
    return items


# ---------------------------------------------------------------- layer ids

def test_default_layer_ids_spread_from_1_to_L_minus_3():
    assert default_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_layer_ids(64) == [1, 16, 31, 46, 61]
    assert default_layer_ids(8, 3) == [1, 3, 5]


def test_default_layer_ids_refuse_a_target_too_shallow_for_distinct_ids():
    with pytest.raises(ValueError, match="--layer-ids"):
        default_layer_ids(6, 5)


def test_layer_id_L_is_refused_with_the_hf_hidden_states_convention():
    with pytest.raises(ValueError) as e:
        check_layer_ids([1, 16, 31, 46, 64], 64)
    msg = str(e.value)
    assert "layer id 64 does not exist" in msg and "ids 0..63" in msg and "hidden_states[i+1] is layer i" in msg


@pytest.mark.parametrize(
    "ids, match",
    [([-1, 3], "negative"), ([1, 3, 3], "duplicates"), ([5, 1, 3], r"not sorted ascending: pass \[1, 3, 5\]"),
     ([], "empty"), ([1.5], "not an integer")],
)
def test_bad_layer_ids_are_refused_never_clamped(ids, match):
    with pytest.raises(ValueError, match=match):
        check_layer_ids(ids, 8)


def test_valid_layer_ids_pass_unchanged_including_0_and_L_minus_1():
    assert check_layer_ids([0, 3, 7], 8) == [0, 3, 7]


def test_final_norm_weight_is_one_plus_w_when_zero_centred():
    w = torch.tensor([0.5, -0.25])
    assert torch.equal(final_norm_weight(w, "rmsnorm"), w)
    assert torch.equal(final_norm_weight(w, "rmsnorm_zero_centred"), 1 + w)
    with pytest.raises(ValueError, match="unknown final norm kind"):
        final_norm_weight(w, "layernorm")


# ---------------------------------------------------------------- round trip

def test_reader_returns_exactly_what_the_writer_wrote(tmp_path):
    items = write_store(tmp_path)
    store = HiddenStateStore(tmp_path)
    assert len(store) == 5
    assert store.lengths.tolist() == [5, 3, 7, 4, 1]
    assert store.hidden_dtype == torch.bfloat16
    for i, want in enumerate(items):
        got = store[i]
        assert set(got) == set(want)
        assert got["hidden"].dtype == torch.bfloat16 and got["hidden"].shape == (store.lengths[i], 3, 16)
        assert got["loss_mask"].dtype == torch.bool and got["input_ids"].dtype == torch.int32
        for name, a in want.items():
            assert np.array_equal(_bits(got[name]), a), name
    assert torch.equal(store[-1]["input_ids"], store[4]["input_ids"])
    with pytest.raises(IndexError):
        store[5]


def test_items_are_views_of_the_mapped_file_not_copies(tmp_path):
    write_store(tmp_path)
    store = HiddenStateStore(tmp_path)
    item = store[2]
    mapped = store._shard_maps(0)["hidden"]
    offset = (5 + 3) * LAYOUT.num_tapped * LAYOUT.hidden_size * 2
    assert item["hidden"].data_ptr() == mapped.ctypes.data + offset
    item["hidden"].zero_()  # copy-on-write mapping: the file is untouched
    assert HiddenStateStore(tmp_path)[2]["hidden"].abs().sum() > 0


def test_store_without_last_has_no_last_field(tmp_path):
    layout = Layout(num_tapped=2, hidden_size=8, topk=1, dtype="float16", has_last=False)
    write_store(tmp_path, layout=layout, lengths=[[3, 2]])
    item = HiddenStateStore(tmp_path)[0]
    assert "last" not in item and item["hidden"].dtype == torch.float16
    assert not os.path.exists(tmp_path / "shards" / "rank00000-shard00000" / "last.bin")


def test_pickled_store_does_not_carry_mapped_data(tmp_path):
    write_store(tmp_path, lengths=[[200, 300]])
    store = HiddenStateStore(tmp_path)
    store[0]
    blob = pickle.dumps(store)
    assert len(blob) < 20_000
    assert torch.equal(pickle.loads(blob)[1]["hidden"], store[1]["hidden"])


# ---------------------------------------------------------------- crash safety and refusals

def test_shard_commit_refuses_a_shard_with_unwritten_sequences(tmp_path):
    writer = StoreWriter(str(tmp_path), LAYOUT)
    shard = writer.open_shard("rank00000-shard00000", [2, 3], {"job": "test"})
    shard.write(0, _random_sequence(LAYOUT, 2, torch.Generator().manual_seed(0)))
    with pytest.raises(RuntimeError, match=r"sequences \[1\] were never written"):
        shard.commit()
    shard.close()
    assert os.path.isdir(tmp_path / "shards" / "rank00000-shard00000.tmp")
    assert not os.path.exists(tmp_path / "shards" / "rank00000-shard00000")
    assert writer.remove_torn(0) == ["rank00000-shard00000.tmp"]


def test_store_without_manifest_is_reported_as_unfinished(tmp_path):
    StoreWriter(str(tmp_path), LAYOUT)
    with pytest.raises(FileNotFoundError, match="did not finish; re-run the same command"):
        HiddenStateStore(tmp_path)


def test_reader_refuses_a_truncated_shard_and_names_the_file(tmp_path):
    write_store(tmp_path)
    path = tmp_path / "shards" / "rank00000-shard00001" / "hidden.bin"
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 2)
    with pytest.raises(ValueError, match=rf"{path}: .* truncated"):
        HiddenStateStore(tmp_path)


def test_reader_refuses_a_missing_shard_file_and_names_it(tmp_path):
    write_store(tmp_path)
    path = tmp_path / "shards" / "rank00000-shard00000" / "teacher_lse.bin"
    os.remove(path)
    with pytest.raises(FileNotFoundError, match=str(path)):
        HiddenStateStore(tmp_path)


@pytest.mark.parametrize("name", [MANIFEST, "shards/rank00000-shard00001/" + INDEX])
@pytest.mark.parametrize("text, message", [("[1, 2]", "holds a list, not a"), ("{not json", "is not valid JSON")])
def test_reader_refuses_a_store_json_that_is_no_json_object_and_names_it(tmp_path, name, text, message):
    """A hand-made or damaged manifest or shard index is a ValueError naming the file, never an AttributeError
    traceback from reading a list as a mapping."""
    write_store(tmp_path)
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=rf"{tmp_path / name} {message}"):
        HiddenStateStore(tmp_path)


@contextlib.contextmanager
def edited_json(path):
    """Hand-edit a store's JSON file (its manifest or a shard index): the parsed data, written back on exit by the
    store's own writer, so that only the edit changes the bytes."""
    data = json.loads(path.read_text())
    yield data
    write_json_atomic(str(path), data)


def test_reader_refuses_an_unknown_schema_version(tmp_path):
    write_store(tmp_path)
    with edited_json(tmp_path / MANIFEST) as manifest:
        manifest["schema_version"] = 99
    with pytest.raises(ValueError, match=rf"{tmp_path / MANIFEST}: unknown schema version 99"):
        HiddenStateStore(tmp_path)


def test_reader_refuses_a_manifest_that_disagrees_with_a_shard(tmp_path):
    write_store(tmp_path)
    with edited_json(tmp_path / MANIFEST) as manifest:
        manifest["shards"][1]["num_tokens"] += 1
    index = tmp_path / "shards" / "rank00000-shard00001" / INDEX
    with pytest.raises(ValueError, match=rf"{index}: .*inconsistent"):
        HiddenStateStore(tmp_path)


def test_reader_refuses_a_manifest_whose_dims_disagree_with_the_files(tmp_path):
    write_store(tmp_path)
    with edited_json(tmp_path / MANIFEST) as manifest:
        manifest["hidden_size"] = 32
    with pytest.raises(ValueError, match="hidden.bin: index describes"):
        HiddenStateStore(tmp_path)


# ---------------------------------------------------------------- verify: every byte against its recorded sha256


def _zero_bytes_in_place(path, offset, count):
    """Damage a file the way a bad disk or a careless tool does: same size, some bytes zeroed."""
    with open(path, "r+b") as f:
        f.seek(offset)
        assert f.read(count) != bytes(count), "the bytes to zero are zero already: the damage would be invisible"
        f.seek(offset)
        f.write(bytes(count))


def test_verify_finds_bytes_changed_in_place_and_names_the_file(tmp_path, capsys):
    write_store(tmp_path)
    assert verify_store(tmp_path) == []
    assert cli.main(["verify", str(tmp_path)]) == 0
    assert "every file matches its recorded sha256" in capsys.readouterr().out
    damaged = tmp_path / "shards" / "rank00000-shard00001" / "hidden.bin"
    _zero_bytes_in_place(damaged, 8, 16)
    HiddenStateStore(tmp_path)  # sizes are intact: opening cannot see it
    (problem,) = verify_store(tmp_path)
    assert problem.startswith(f"{damaged}: sha256 ") and "same size" in problem
    assert cli.main(["verify", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: the store {tmp_path} does not verify:") and str(damaged) in err


def test_verify_checks_the_index_against_the_manifest(tmp_path):
    write_store(tmp_path)
    index = tmp_path / "shards" / "rank00000-shard00000" / INDEX
    with edited_json(index) as data:
        data["files"]["last"]["sha256"] = "0" * 64  # a hand-edited index would otherwise vouch for changed bytes
    assert verify_store(tmp_path) == [f"{index}: its sha256 differs from the one the manifest records"]


# ---------------------------------------------------------------- fp8


def test_fp8_round_trip_error_is_within_the_e4m3_bound_and_the_bound_is_tight():
    gen = torch.Generator().manual_seed(0)
    # Rows of very different magnitudes, a row with a few large outliers, an all-zero row.
    x = torch.randn(64, 5, 123, generator=gen) * torch.logspace(-6, 3, 64)[:, None, None]
    x[3, 1, :4] = 1e4
    x[7, 2] = 0
    q, scale = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, 5) and scale.dtype == torch.float32
    torch.testing.assert_close(scale, x.abs().amax(-1) / 448, rtol=0, atol=0)
    back = dequantize_fp8(q, scale, torch.float32)
    bound = 2**-4 * x.abs() + 2**-10 * scale[..., None]
    err = (back - x).abs()
    assert (err <= bound).all(), f"fp8 error exceeds 2^-4 |x| + 2^-10 scale by up to {(err - bound).max():.3g}"
    assert (err / bound)[bound > 0].max() > 0.9, "the bound should be reached: else it tests nothing"
    assert (back[7, 2] == 0).all() and scale[7, 2] == 0
    bf16 = dequantize_fp8(q, scale)  # the loader's read dtype adds one bf16 rounding
    assert bf16.dtype == torch.bfloat16
    assert ((bf16.float() - back).abs() <= 2**-8 * back.abs()).all()


def test_fp8_store_holds_half_the_bytes_of_bf16_at_the_qwen3_8b_shape():
    per_dtype = {d: Layout(5, 4096, 8, d, True).field_bytes() for d in ("bfloat16", "float8_e4m3fn")}
    assert per_dtype["float8_e4m3fn"]["hidden"] == 5 * 4096 and per_dtype["float8_e4m3fn"]["hidden_scale"] == 5 * 4
    states = {d: sum(b[k] for k in b if k.startswith(("hidden", "last"))) for d, b in per_dtype.items()}
    assert states["float8_e4m3fn"] / states["bfloat16"] == pytest.approx(0.5, abs=0.001)
    total = {d: Layout(5, 4096, 8, d, True).bytes_per_token() for d in per_dtype}
    assert total["float8_e4m3fn"] / total["bfloat16"] < 0.502


def test_fp8_store_round_trips_bits_and_scales_and_is_schema_version_2(tmp_path):
    layout = Layout(num_tapped=3, hidden_size=16, topk=4, dtype="float8_e4m3fn", has_last=True)
    items = write_store(tmp_path, layout=layout)
    store = HiddenStateStore(tmp_path)
    assert store.manifest["schema_version"] == 2 and store.hidden_dtype == torch.float8_e4m3fn
    for i, want in enumerate(items):
        got = store[i]
        assert set(got) == set(want) and {"hidden_scale", "last_scale"} <= set(got)
        assert got["hidden"].dtype == torch.float8_e4m3fn and got["hidden_scale"].shape == (store.lengths[i], 3)
        for name, a in want.items():
            assert np.array_equal(_bits(got[name]), a), name
    no_last = Layout(num_tapped=3, hidden_size=16, topk=4, dtype="float8_e4m3fn", has_last=False)
    assert "last_scale" not in no_last.fields() and "hidden_scale" in no_last.fields()


def test_stores_written_before_fp8_stay_readable(tmp_path):
    """Version 1 (no fp8) is what every store before fp8 is: no dtype in the shard indices."""
    items = write_store(tmp_path)
    for shard in (tmp_path / "shards").iterdir():
        with edited_json(shard / INDEX) as index:
            assert index.pop("dtype") == "bfloat16" and index["schema_version"] == 1
    store = HiddenStateStore(tmp_path)
    assert store.manifest["schema_version"] == 1
    assert np.array_equal(_bits(store[2]["hidden"]), items[2]["hidden"])


def test_store_refuses_shards_of_mixed_dtypes(tmp_path):
    fp8 = Layout(num_tapped=3, hidden_size=16, topk=4, dtype="float8_e4m3fn", has_last=True)
    write_store(tmp_path, layout=fp8)
    # Shard 1 redone by an extraction of another --dtype: bf16 files under an fp8 manifest.
    other = tmp_path / "other"
    write_store(other, layout=LAYOUT)
    shard = tmp_path / "shards" / "rank00000-shard00001"
    for f in shard.iterdir():
        f.unlink()
    for f in (other / "shards" / "rank00000-shard00001").iterdir():
        (shard / f.name).write_bytes(f.read_bytes())
    holds = r"shard00001/index.json: this shard holds bfloat16 hidden states, the store's manifest \(and every"
    with pytest.raises(ValueError, match=holds + r" other shard\) float8_e4m3fn: a store holds one dtype"):
        HiddenStateStore(tmp_path)
