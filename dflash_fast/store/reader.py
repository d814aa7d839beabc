"""Reading a store: `HiddenStateStore` maps a store directory written by `dflash-fast extract`, and
`dflash-fast verify STORE` checks every byte of it against the sha256 sums recorded at extraction.

The format (fields, dtypes, the manifest and the shard checks the reader runs on open) is store_format.py's;
store_writer.py writes a store.
"""
import bisect
import os
from typing import Dict, List, Optional

import numpy as np
import torch

from dflash_fast.store.format import (
    DTYPES,
    INDEX,
    MANIFEST,
    SHARDS_DIR,
    Layout,
    check_shard,
    read_index,
    read_manifest,
    sha256_file,
    shard_dirs,
)


class HiddenStateStore:
    """Memory-mapped reader of a store directory written by `dflash-fast extract`.

    `store[i]` -> dict of torch tensors (views of the mapped files; store_format.py's
    docstring gives names, shapes and dtypes). `store.lengths` [N] int64
    holds every item's token count without touching the big files.
    """

    def __init__(self, path: str):
        self.path = str(path)
        manifest_path = os.path.join(self.path, MANIFEST)
        if not os.path.exists(manifest_path):
            torn = os.path.isdir(os.path.join(self.path, SHARDS_DIR))
            raise FileNotFoundError(
                f"{manifest_path} is missing: "
                + ("the extraction did not finish; re-run the same command to resume it" if torn else "not a store")
            )
        self.manifest = m = read_manifest(self.path)
        version = m["schema_version"]
        if m["dtype"] not in DTYPES:
            raise ValueError(f"{manifest_path}: unknown dtype {m['dtype']!r}; the manifest is corrupted")
        self.layout = Layout.from_manifest(m)
        if version != self.layout.schema_version:
            raise ValueError(
                f"{manifest_path}: schema version {version} with dtype {m['dtype']} (a {m['dtype']} store is version "
                f"{self.layout.schema_version}); the manifest is corrupted"
            )
        self.hidden_dtype = DTYPES[m["dtype"]][1]
        self._specs = []
        lengths, content = [], []
        self.shard_dirs = shard_dirs(self.path, m["shards"], manifest_path)
        for shard, entry in zip(self.shard_dirs, m["shards"]):
            if not os.path.isdir(shard):
                raise FileNotFoundError(f"{shard}: shard listed in the manifest is missing")
            index = read_index(shard)
            expect = {"num_sequences": entry["num_sequences"], "num_tokens": entry["num_tokens"]}
            self._specs.append(check_shard(shard, self.layout, index, expect))
            lengths.append(np.asarray(index["lengths"], dtype=np.int64))
            content.append(index.get("content"))
        self.lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
        if len(self.lengths) != m["num_sequences"] or int(self.lengths.sum()) != m["num_tokens"]:
            raise ValueError(
                f"{manifest_path}: shards hold {len(self.lengths)} sequences / {int(self.lengths.sum())} tokens, "
                f"the manifest says {m['num_sequences']} / {m['num_tokens']}; the store is inconsistent"
            )
        # Each document's content key (writer.content_key), or None for a store written before they were recorded.
        self.content: Optional[List[str]] = None
        if all(c is not None and len(c) == len(n) for c, n in zip(content, lengths)):
            self.content = [key for c in content for key in c]
        per_shard = [int(n["num_sequences"]) for n in m["shards"]]
        self._first_item = np.concatenate([[0], np.cumsum(per_shard)]).tolist()
        self._token_starts = []
        first = 0
        for count in per_shard:
            shard_lengths = self.lengths[first : first + count]
            self._token_starts.append(np.concatenate([[0], np.cumsum(shard_lengths)]))
            first += count
        self._maps = {}

    def __len__(self) -> int:
        return len(self.lengths)

    def _shard_maps(self, s: int) -> Dict[str, np.memmap]:
        if s not in self._maps:
            # Copy-on-write: torch gets writable views; nothing a caller does reaches the file.
            self._maps[s] = {
                field: np.memmap(path, dtype=np_dtype, mode="c", shape=shape)
                for field, (path, np_dtype, shape) in self._specs[s].items()
            }
        return self._maps[s]

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"store item {i} out of range for {n} items")
        i %= n
        s = bisect.bisect_right(self._first_item, i) - 1
        j = i - self._first_item[s]
        a, b = int(self._token_starts[s][j]), int(self._token_starts[s][j + 1])
        return self.layout.tensors({field: arr[a:b] for field, arr in self._shard_maps(s).items()})

    def __getstate__(self):
        # Mapped arrays would be pickled by value; DataLoader workers re-map lazily instead.
        state = dict(self.__dict__)
        state["_maps"] = {}
        return state

    def __repr__(self) -> str:
        m = self.manifest
        return (
            f"HiddenStateStore({self.path!r}: {len(self)} sequences, {m['num_tokens']} tokens, "
            f"layer ids {m['layer_ids']}, H={m['hidden_size']}, {m['dtype']}, last={m['has_last']})"
        )


# ---------------------------------------------------------------- `dflash-fast verify STORE`


def verify_store(path: str) -> List[str]:
    """Why the store at `path` is not what its extraction wrote: [] when every shard file matches the sha256
    recorded at extraction (the manifest holds each shard index's sum, each index its files' sums). Opening the
    store first checks the manifest, every index and every file's size (raises on those)."""
    store = HiddenStateStore(path)
    problems = []
    for shard, entry in zip(store.shard_dirs, store.manifest["shards"]):
        index_path = os.path.join(shard, INDEX)
        if "index_sha256" not in entry:
            problems.append(f"{shard}: no sha256 recorded (extracted by an older dflash-fast); re-extract to verify it")
            continue
        if sha256_file(index_path) != entry["index_sha256"]:
            problems.append(f"{index_path}: its sha256 differs from the one the manifest records")
            continue
        files = read_index(shard)["files"]
        for field in store.layout.fields():
            file = os.path.join(shard, field + ".bin")
            digest, recorded = sha256_file(file), str(files[field].get("sha256"))
            if digest != recorded:
                problems.append(
                    f"{file}: sha256 {digest[:16]}... differs from the recorded {recorded[:16]}... "
                    f"(same size: its bytes were changed)"
                )
    return problems


def add_arguments(parser) -> None:
    parser.add_argument("store", metavar="STORE", help="a store directory written by `dflash-fast extract`")


def run(args) -> int:
    problems = verify_store(args.store)
    if problems:
        raise ValueError(
            f"the store {args.store} does not verify:\n  - " + "\n  - ".join(problems) + "\ndelete the damaged "
            "shard directories and re-run the same `dflash-fast extract` command: it redoes missing shards"
        )
    m = read_manifest(args.store)
    print(f"{args.store}: {len(m['shards'])} shards, {m['num_tokens']} tokens: every file matches its recorded sha256")
    return 0
