"""Writing a store: one shard at a time into `<name>.tmp/`, renamed into place when complete, and the manifest
last, over checked shards only (the format: store_format.py). Any rank writes its own shards; rank 0 writes the
manifest. Resuming keeps complete shards, deletes torn ones and refuses a shard of another extraction.
"""
import hashlib
import os
import shutil
import sys
from typing import Dict, List, Sequence

import numpy as np

from dflash_fast.store.format import (
    INDEX,
    MANIFEST,
    SHARDS_DIR,
    TMP_SUFFIX,
    Layout,
    check_shard,
    fsync_dir,
    read_index,
    sha256_file,
    shard_dirs,
    write_json_atomic,
)
from dflash_fast.store.reader import HiddenStateStore


class ShardWriter:
    """Writes one shard of known sequence lengths into `<name>.tmp/`, then renames it into place.

    Files are pre-sized from `lengths`, and each sequence is written at its own
    offset, so batches may arrive in any order (the extractor sorts them by
    length) and the bytes on disk do not depend on that order.
    """

    def __init__(self, shards_dir: str, name: str, layout: Layout, lengths: Sequence[int], meta: dict):
        self.final = os.path.join(shards_dir, name)
        self.tmp = self.final + TMP_SUFFIX
        self.layout = layout
        self.lengths = [int(n) for n in lengths]
        self.starts = np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)])
        self.meta = meta
        self.written = np.zeros(len(self.lengths), dtype=bool)
        self.content: List[str] = [""] * len(self.lengths)
        self.bytes_written = 0
        shutil.rmtree(self.tmp, ignore_errors=True)
        os.makedirs(self.tmp)
        self.fds = {}
        num_tokens = int(self.starts[-1])
        for field, (np_dtype, shape, _) in layout.fields().items():
            fd = os.open(os.path.join(self.tmp, field + ".bin"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            os.ftruncate(fd, num_tokens * self._row_bytes(field))
            self.fds[field] = fd

    def _row_bytes(self, field: str) -> int:
        np_dtype, shape, _ = self.layout.fields()[field]
        return np.dtype(np_dtype).itemsize * int(np.prod(shape, dtype=np.int64))

    def write(self, i: int, arrays: Dict[str, np.ndarray]) -> None:
        """Write sequence `i` of this shard: arrays[field] is `[n_i, *shape]` in the field's dtype."""
        n = self.lengths[i]
        for field, (np_dtype, shape, _) in self.layout.fields().items():
            a = np.ascontiguousarray(arrays[field])
            if a.dtype != np.dtype(np_dtype) or a.shape != (n, *shape):
                raise ValueError(
                    f"{field} of sequence {i}: got {a.dtype}{list(a.shape)}, expected {np.dtype(np_dtype)}{[n, *shape]}"
                )
            os.pwrite(self.fds[field], a.data, int(self.starts[i]) * self._row_bytes(field))
            self.bytes_written += a.nbytes
        self.content[i] = content_key(arrays["input_ids"], arrays["loss_mask"])
        self.written[i] = True

    def commit(self) -> None:
        """Flush, write index.json and atomically rename the shard into place."""
        missing = np.flatnonzero(~self.written)
        if len(missing):
            raise RuntimeError(f"{self.tmp}: sequences {missing[:8].tolist()} were never written; not committing")
        files = {}
        for field, (np_dtype, shape, _) in self.layout.fields().items():
            os.fsync(self.fds[field])
            os.close(self.fds[field])
            files[field] = {
                "dtype": np.dtype(np_dtype).name,
                "shape": [int(self.starts[-1]), *shape],
                "sha256": sha256_file(os.path.join(self.tmp, field + ".bin")),  # for `dflash-fast verify`
            }
        self.fds = {}
        index = {
            "schema_version": self.layout.schema_version,
            "dtype": self.layout.dtype,
            **self.meta,
            "num_sequences": len(self.lengths),
            "num_tokens": int(self.starts[-1]),
            "files": files,
            "lengths": self.lengths,
            "content": self.content,
        }
        write_json_atomic(os.path.join(self.tmp, INDEX), index)
        os.replace(self.tmp, self.final)
        fsync_dir(os.path.dirname(self.final))

    def close(self) -> None:
        """Release file handles without committing (the `.tmp` directory stays, torn)."""
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def content_key(input_ids: np.ndarray, loss_mask: np.ndarray) -> str:
    """What a document teaches, as 16 hex digits: the sha256 of its trained tokens (input_ids where loss_mask; all of
    them when nothing is masked). Two documents with the same response under different prompts share it; the
    validation split keeps them on one side (data/batches.split_documents)."""
    ids = np.asarray(input_ids, dtype=np.int32)
    mask = np.asarray(loss_mask, dtype=bool)
    return hashlib.sha256((ids[mask] if mask.any() else ids).tobytes()).hexdigest()[:16]


class StoreWriter:
    """Creates and resumes a store directory: shards (any rank) and the manifest (rank 0, last)."""

    def __init__(self, path: str, layout: Layout):
        self.path = path
        self.layout = layout
        self.shards_dir = os.path.join(path, SHARDS_DIR)
        os.makedirs(self.shards_dir, exist_ok=True)

    @staticmethod
    def shard_name(rank: int, index: int) -> str:
        return f"rank{rank:05d}-shard{index:05d}"

    def remove_torn(self, rank: int) -> List[str]:
        """Delete this rank's `.tmp` shards left by a crash; return their names."""
        prefix = f"rank{rank:05d}-"
        torn = [d for d in os.listdir(self.shards_dir) if d.startswith(prefix) and d.endswith(TMP_SUFFIX)]
        for d in torn:
            shutil.rmtree(os.path.join(self.shards_dir, d))
        return torn

    def is_complete(self, name: str, lengths: Sequence[int], meta: dict) -> bool:
        """True when shard `name` exists, holds exactly `lengths` and was written with `meta`.

        A damaged shard (unreadable index, a missing or truncated file) is deleted and reported: False, the
        caller redoes it. A complete shard written from different inputs or settings is refused, not
        overwritten: the directory belongs to another extraction.
        """
        shard = os.path.join(self.shards_dir, name)
        if not os.path.isdir(shard):
            return False
        try:
            index = read_index(shard)
        except (FileNotFoundError, ValueError) as e:
            return self._discard(shard, e)
        theirs = {k: index.get(k) for k in meta}
        if theirs != meta or index.get("lengths") != [int(n) for n in lengths]:
            diff = sorted(k for k in meta if theirs[k] != meta[k]) or ["lengths"]
            raise ValueError(
                f"{shard} was written by a different extraction (differs in {', '.join(diff)}); "
                f"use a new --out directory or delete {self.path}"
            )
        try:
            check_shard(shard, self.layout, index, expect=None)
        except (FileNotFoundError, ValueError) as e:
            return self._discard(shard, e)
        return True

    @staticmethod
    def _discard(shard: str, why: Exception) -> bool:
        print(f"{shard} is damaged ({why}); redoing it", file=sys.stderr)
        shutil.rmtree(shard)
        return False

    def open_shard(self, name: str, lengths: Sequence[int], meta: dict) -> ShardWriter:
        return ShardWriter(self.shards_dir, name, self.layout, lengths, meta)

    def write_manifest(self, manifest: dict) -> None:
        """Check every shard `manifest["shards"]` lists, then write manifest.json atomically.

        The manifest is the store's claim of completeness, so it is written
        last and only over complete, consistent shards.
        """
        shards = []
        for shard, entry in zip(shard_dirs(self.path, manifest["shards"], "the shards of this extraction"),
                                manifest["shards"]):
            index = read_index(shard)
            check_shard(shard, self.layout, index, {k: entry[k] for k in ("num_sequences", "num_tokens")})
            # The index holds its files' sha256: the manifest's sum of the index closes the chain `verify` checks.
            shards.append({**entry, "index_sha256": sha256_file(os.path.join(shard, INDEX))})
        write_json_atomic(
            os.path.join(self.path, MANIFEST),
            {"schema_version": self.layout.schema_version, **manifest, "shards": shards},
        )
        HiddenStateStore(self.path)
