"""The validation split holds out content, not only documents: two documents that teach the same tokens (one
response under two prompts: the quickstart's documents 120 and 282) are held out or kept together. A store records
each document's content key (store/writer.content_key: the hash of its trained tokens); a store written before
the keys were recorded splits document by document, exactly as before (its runs resume onto the same split)."""
import numpy as np
import pytest
import torch
from test_store import LAYOUT, _random_sequence, write_store

from dflash_fast.data.batches import _TAG_SPLIT, derive_seed, split_documents
from dflash_fast.store.format import INDEX, read_json, write_json_atomic
from dflash_fast.store.reader import HiddenStateStore
from dflash_fast.store.writer import StoreWriter, content_key


def test_the_key_is_the_trained_tokens_whatever_the_prompt():
    response = np.array([7, 8, 9, 10], dtype=np.int32)
    a = content_key(np.concatenate([[1, 2, 3], response]), np.array([0, 0, 0, 1, 1, 1, 1], dtype=bool))
    b = content_key(np.concatenate([[1, 2, 3, 4, 5], response]), np.array([0] * 5 + [1] * 4, dtype=bool))
    c = content_key(np.concatenate([[1, 2, 3], response[::-1]]), np.array([0, 0, 0, 1, 1, 1, 1], dtype=bool))
    assert a == b != c


def store_with_a_repeated_response(path, docs=40, pairs=((3, 17), (8, 30), (12, 13))):
    """A store of `docs` documents in which each pair shares its response (the second a longer prompt)."""
    rng = torch.Generator().manual_seed(0)
    lengths = [6 + i % 5 for i in range(docs)]
    for a, b in pairs:
        lengths[b] = lengths[a] + 2
    seqs = [_random_sequence(LAYOUT, n, rng) for n in lengths]
    for a, b in pairs:  # b: two more prompt tokens, then a's trained tokens
        seqs[b]["input_ids"][2:] = seqs[a]["input_ids"]
        seqs[b]["loss_mask"][:] = np.concatenate([[False, False], seqs[a]["loss_mask"]])
    writer = StoreWriter(str(path), LAYOUT)
    shard = writer.open_shard(writer.shard_name(0, 0), lengths, {"job": "test"})
    for i, s in enumerate(seqs):
        shard.write(i, s)
    shard.commit()
    writer.write_manifest({"layer_ids": [0, 1, 2], "hidden_size": LAYOUT.hidden_size, "topk": LAYOUT.topk,
                           "dtype": LAYOUT.dtype, "has_last": True, "num_sequences": docs, "num_tokens": sum(lengths),
                           "shards": [{"name": writer.shard_name(0, 0), "num_sequences": docs,
                                       "num_tokens": sum(lengths)}]})
    return HiddenStateStore(str(path)), pairs


def test_documents_with_the_same_response_never_straddle_the_split(tmp_path):
    store, pairs = store_with_a_repeated_response(tmp_path)
    assert store.content is not None and len(set(store.content)) == len(store) - len(pairs)
    for seed in range(30):
        train, val = split_documents(len(store), 0.25, seed, store.content)
        assert len(val) >= 10 and len(train) + len(val) == len(store) and not set(train) & set(val)
        for a, b in pairs:
            assert (a in val) == (b in val), f"split_seed {seed}: documents {a} and {b} share a response"
    # Without the keys some seed splits a pair: the test above can fail.
    assert any((a in split_documents(len(store), 0.25, s)[1]) != (b in split_documents(len(store), 0.25, s)[1])
               for s in range(30) for a, b in pairs)


def test_a_store_without_keys_splits_document_by_document_as_before(tmp_path):
    write_store(tmp_path)
    for index_path in (tmp_path / "shards").glob(f"*/{INDEX}"):
        index = read_json(str(index_path), "a shard index")
        del index["content"]  # as a store written before the keys
        write_json_atomic(str(index_path), index)
    store = HiddenStateStore(str(tmp_path))
    assert store.content is None
    perm = np.random.default_rng(derive_seed(7, _TAG_SPLIT)).permutation(len(store))
    train, val = split_documents(len(store), 0.4, 7, store.content)
    assert val.tolist() == sorted(perm[:2]) and train.tolist() == sorted(perm[2:])


def test_groups_that_leave_no_training_document_are_refused():
    with pytest.raises(ValueError, match="holding out whole groups leaves none for training"):
        split_documents(4, 0.25, 0, ["same"] * 4)
