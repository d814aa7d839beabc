"""The on-disk format of the hidden-state store: what extraction writes and training reads (spec.md §1-2).

One store item is one document (a sequence of `n` tokens). Per token it holds:

    input_ids            [n]        int32
    loss_mask            [n]        bool     1 on tokens the drafter learns to draft
    hidden               [n, K, H]  dtype    outputs of the tapped decoder layers (pre final norm)
    last                 [n, H]     dtype    final residual stream BEFORE the final norm (optional)
    teacher_topk_ids     [n, k]     int32    the target's top-k next-token ids, logits descending
    teacher_topk_logits  [n, k]     float32  their logits
    teacher_lse          [n]        float32  full log-sum-exp of the target's logits
    hidden_scale         [n, K]     float32  fp8 stores only: absmax / 448 of each token's layer
    last_scale           [n]        float32  fp8 stores only, with `last`

`dtype` is bfloat16 (stored as its uint16 bits: numpy has no bf16), float16,
float32 or float8_e4m3fn (its uint8 bits). An fp8 value is `x / scale` rounded
to e4m3 with one fp32 scale per token and layer, `scale = absmax(x) / 448`;
`dequantize_fp8` gives back `q * scale` (the loader does this on read; fp8.py). Schema
version 1 is every store without fp8; version 2 adds fp8 and its scale files, so
a reader that knows only version 1 refuses an fp8 store by its version, and the
bf16/fp16/fp32 stores written before fp8 existed stay readable unchanged.
On disk a store is a directory:

    manifest.json                    written last: its presence means "complete"
    shards/rank00000-shard00000/     one directory a shard, renamed into place when complete
        index.json                   its dtype, per-sequence lengths and content keys (the validation split groups
                                     by them), file shapes and sha256 sums, the inputs' hash
        input_ids.bin ... last.bin   raw little-endian arrays, one per field

Each `.bin` is a flat C-order array memory-mapped with `np.memmap`: reading
one item touches only its bytes, and a torch tensor is a view of the mapping,
never a copy (copy-on-write: writing into a tensor never reaches the file). A shard is written into
`<name>.tmp/` and renamed when every sequence is in, so a crash leaves at worst a `.tmp` directory that the next
run deletes and redoes (as it redoes a shard whose files were since lost or truncated). Opening a store checks
every file's size; `dflash-fast verify STORE` (`verify_store`) also checks every byte against the sha256 sums
recorded at extraction: the manifest holds each index's sum, each index its files' sums. Names and counts read
from the JSON files are data, never directions: every field has its declared type (MANIFEST_SCHEMA,
INDEX_SCHEMA), a shard name is one directory inside `shards/` and each shard is listed once (`shard_dirs`).

This module holds the format (file names, dtypes, the JSON schemas, Layout, the manifest, the shard checks, and
the checksummed, crash-safe JSON files every stage writes); store_writer.py writes a store, store.py reads one.
Layer ids are layer_ids.py's (spec.md §1).
"""

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from dflash_fast.errors import (
    BOOL,
    COUNT,
    INT,
    OBJECT,
    POSITIVE,
    SHA256,
    STR,
    ListOf,
    MapOf,
    Obj,
    check_schema,
    read_mapping,
)
from dflash_fast.store.fp8 import FP8
from dflash_fast.store.layer_ids import LAYER_ID_CONVENTION

SCHEMA_VERSIONS = (1, 2)  # readable; the version of a store is Layout.schema_version
MANIFEST = "manifest.json"
INDEX = "index.json"
SHARDS_DIR = "shards"
TMP_SUFFIX = ".tmp"

# name -> (numpy dtype on disk, torch dtype of the view)
DTYPES = {
    "bfloat16": (np.uint16, torch.bfloat16),
    "float16": (np.float16, torch.float16),
    "float32": (np.float32, torch.float32),
    "float8_e4m3fn": (np.uint8, torch.float8_e4m3fn),
}
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "float8_e4m3fn"}

# The shape of the JSON files of a store (errors.check_schema): what a reader needs from a manifest, plus the
# types of what extraction records besides (the target, L, V, the final norm, input counts) where present.
SHARD_ENTRY = Obj(
    {"name": STR, "num_sequences": COUNT, "num_tokens": COUNT},
    optional={"num_loss_tokens": COUNT, "index_sha256": SHA256},
)
MANIFEST_SCHEMA = Obj(
    {"schema_version": INT, "layer_ids": ListOf(COUNT), "hidden_size": POSITIVE, "topk": POSITIVE, "dtype": STR,
     "has_last": BOOL, "num_sequences": COUNT, "num_tokens": COUNT, "shards": ListOf(SHARD_ENTRY)},
    optional={"target": Obj({}, optional={"path": STR, "config_sha256": STR}), "num_layers": POSITIVE,
              "vocab_size": POSITIVE, "final_norm": Obj({}, optional={"kind": STR}),
              "extraction": Obj({}, optional={"job": STR, "input": OBJECT})},
)
INDEX_SCHEMA = Obj(
    {"num_sequences": COUNT, "num_tokens": COUNT, "lengths": ListOf(COUNT),
     "files": MapOf(Obj({"dtype": STR, "shape": ListOf(COUNT)}, optional={"sha256": SHA256}))},
    optional={"schema_version": INT, "dtype": STR, "job": STR, "inputs_sha256": STR, "content": ListOf(STR)},
)


# ---------------------------------------------------------------- layout


@dataclass(frozen=True)
class Layout:
    """Per-token shapes of every field; what the writer lays down and the reader expects."""

    num_tapped: int
    hidden_size: int
    topk: int
    dtype: str
    has_last: bool

    @classmethod
    def from_manifest(cls, manifest: dict) -> "Layout":
        """The layout a store's manifest (or an online source's) describes."""
        m = manifest
        return cls(len(m["layer_ids"]), m["hidden_size"], m["topk"], m["dtype"], m["has_last"])

    def fields(self) -> Dict[str, tuple]:
        """name -> (numpy dtype, per-token shape, torch dtype of the view)."""
        np_h, torch_h = DTYPES[self.dtype]
        out = {
            "input_ids": (np.int32, (), torch.int32),
            "loss_mask": (np.bool_, (), torch.bool),
            "hidden": (np_h, (self.num_tapped, self.hidden_size), torch_h),
            "last": (np_h, (self.hidden_size,), torch_h),
            "teacher_topk_ids": (np.int32, (self.topk,), torch.int32),
            "teacher_topk_logits": (np.float32, (self.topk,), torch.float32),
            "teacher_lse": (np.float32, (), torch.float32),
        }
        if self.dtype == FP8:
            out["hidden_scale"] = (np.float32, (self.num_tapped,), torch.float32)
            out["last_scale"] = (np.float32, (), torch.float32)
        if not self.has_last:
            del out["last"]
            out.pop("last_scale", None)
        return out

    def tensors(self, arrays: Dict[str, np.ndarray]) -> Dict[str, torch.Tensor]:
        """Arrays in the on-disk dtypes (as the writer takes them, or mapped from the files) -> torch views in the
        fields' dtypes (bf16 and fp8 from their bits), no copy."""
        fields = self.fields()
        out = {}
        for name, arr in arrays.items():
            t = torch.from_numpy(arr)
            out[name] = t.view(fields[name][2]) if t.dtype != fields[name][2] else t
        return out

    def field_bytes(self) -> Dict[str, int]:
        """name -> bytes per token."""
        return {name: np.dtype(d).itemsize * int(np.prod(s, dtype=np.int64)) for name, (d, s, _) in
                self.fields().items()}

    def bytes_per_token(self) -> int:
        return sum(self.field_bytes().values())

    @property
    def schema_version(self) -> int:
        return 2 if self.dtype == FP8 else 1


def normalise_dtype(name: str) -> str:
    """'bf16' | 'bfloat16' | 'fp8' | ... -> canonical store dtype name."""
    canon = DTYPE_ALIASES.get(name, name)
    if canon not in DTYPES:
        raise ValueError(f"unknown store dtype {name!r}; choose bf16, fp16, fp32 or fp8")
    return canon


def torch_dtype(name: str) -> torch.dtype:
    """'bf16' | 'bfloat16' | 'fp16' | ... -> the torch dtype (the one dtype-name map of the project)."""
    return DTYPES[normalise_dtype(name)][1]


# ---------------------------------------------------------------- checksums and crash-safe JSON files


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_json(path: str, what: str, schema: Optional[Obj] = None) -> dict:
    """The JSON object at `path`: FileNotFoundError when it is missing, ValueError when it is not one or a field
    does not have the shape `schema` declares (a damaged store, or a file that is no store's)."""
    return read_mapping(path, json.load, json.JSONDecodeError, ValueError, "JSON", f"{what} (a JSON object)",
                        missing=FileNotFoundError, schema=schema)


def read_index(shard: str) -> dict:
    return read_json(os.path.join(shard, INDEX), "a shard index", INDEX_SCHEMA)


def shard_dirs(path: str, entries: Sequence[dict], listed_in: str) -> List[str]:
    """The directory of each shard entry of a manifest (or a rank's note) `listed_in`, for the store at `path`.

    A shard name comes from a file, so it is refused unless it names one directory inside `path`/shards (no
    separator, no `..`, not absolute, not a `.tmp` leftover), and unless every shard is a different directory
    (a shard listed twice, or two names of one directory through a symlink, would train its documents twice).
    The shard directory itself may be a symlink to another disk: the name stays inside the store."""
    dirs, seen = [], {}
    for i, entry in enumerate(entries):
        name = entry["name"]
        if (name in ("", ".", "..") or os.path.basename(name) != name or "/" in name or "\\" in name
                or "\0" in name or name.endswith(TMP_SUFFIX)):
            raise ValueError(f"{listed_in}: shards[{i}].name {name!r} is not the name of a shard directory in "
                             f"{os.path.join(path, SHARDS_DIR)}; the file is corrupted or was not written by "
                             f"dflash-fast")
        shard = os.path.join(path, SHARDS_DIR, name)
        real = os.path.realpath(shard)
        if real in seen:
            raise ValueError(f"{listed_in}: shards[{i}] ({name}) is the shard directory of shards[{seen[real]}] "
                             f"again: each shard is listed once, or its documents would be read twice")
        seen[real] = i
        dirs.append(shard)
    return dirs


def write_json_atomic(path: str, obj: dict) -> None:
    """Write `obj` to `path` so that a crash leaves the old file or the new one, never a torn one (fsynced,
    renamed into place, directory fsynced): every JSON marker and manifest of the project goes through here."""
    tmp = path + TMP_SUFFIX
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- the manifest


def build_manifest(*, target: dict, num_layers: int, vocab_size: int, layer_ids: Sequence[int], layout: Layout,
                   compute_dtype: str, final_norm: dict, extraction: dict) -> dict:
    """A store's manifest before its shards are counted (the writer adds shards and counts, then writes it):
    what a reader needs to trust the files — the target and its sizes, the layer ids and their convention,
    dtypes, whether `last` is stored and is pre-norm, the final norm, the teacher top-k."""
    return {
        "format": "dflash-fast hidden-state store",
        "target": target,
        "num_layers": num_layers,
        "hidden_size": layout.hidden_size,
        "vocab_size": vocab_size,
        "layer_ids": list(layer_ids),
        "layer_id_convention": LAYER_ID_CONVENTION,
        "dtype": layout.dtype,
        "compute_dtype": compute_dtype,
        "has_last": layout.has_last,
        "last_is_pre_norm": True,
        "final_norm": final_norm,
        "topk": layout.topk,
        "extraction": extraction,
    }


def read_manifest(path: str) -> Optional[dict]:
    """The manifest of the store at `path` (its version known, its fields of the declared types), or None when
    there is none (yet)."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.exists(manifest_path):
        return None
    manifest = read_json(manifest_path, "a store manifest")
    version = manifest.get("schema_version")
    if version not in SCHEMA_VERSIONS:  # before the schema: a newer store's fields may differ
        raise ValueError(
            f"{manifest_path}: unknown schema version {version!r}; this reader understands versions "
            f"{', '.join(map(str, SCHEMA_VERSIONS))}: re-extract with this version of dflash-fast"
        )
    return check_schema(manifest, MANIFEST_SCHEMA, manifest_path)


# ---------------------------------------------------------------- shard checks


def check_shard(shard: str, layout: Layout, index: dict, expect: Optional[dict]) -> Dict[str, tuple]:
    """Check a shard's index and file sizes against `layout` (and the manifest's `expect`).

    Returns field -> (path, numpy dtype, shape) for mapping. Only stats the
    files: a store with thousands of shards opens without mapping any.
    """
    index_path = os.path.join(shard, INDEX)
    dtype = index.get("dtype", layout.dtype)  # version-1 indices name no dtype: their files' dtypes are checked below
    if dtype != layout.dtype:
        raise ValueError(
            f"{index_path}: this shard holds {dtype} hidden states, the store's manifest (and every other shard) "
            f"{layout.dtype}: a store holds one dtype; re-run the same extraction to redo the shard"
        )
    if index.get("schema_version") != layout.schema_version:
        raise ValueError(
            f"{index_path}: schema version {index.get('schema_version')!r}, a {layout.dtype} store is version "
            f"{layout.schema_version}; the store is inconsistent"
        )
    lengths = index.get("lengths", [])
    num_tokens = index.get("num_tokens")
    if sum(lengths) != num_tokens or len(lengths) != index.get("num_sequences"):
        raise ValueError(f"{index_path}: lengths disagree with num_sequences/num_tokens; the shard is corrupted")
    if expect is not None:
        got = {k: index.get(k) for k in expect}
        if got != expect:
            raise ValueError(f"{index_path}: shard holds {got}, the manifest says {expect}; the store is inconsistent")
    specs = {}
    for field, (np_dtype, shape, _) in layout.fields().items():
        path = os.path.join(shard, field + ".bin")
        want_shape = [num_tokens, *shape]
        described = index.get("files", {}).get(field)
        described = {k: described.get(k) for k in ("dtype", "shape")} if isinstance(described, dict) else described
        if described != {"dtype": np.dtype(np_dtype).name, "shape": want_shape}:
            raise ValueError(
                f"{path}: index describes {described}, the manifest implies "
                f"{{'dtype': '{np.dtype(np_dtype).name}', 'shape': {want_shape}}}; the store is inconsistent"
            )
        want_bytes = np.dtype(np_dtype).itemsize * int(np.prod(want_shape, dtype=np.int64))
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: shard file is missing; re-run the extraction to redo it") from None
        if size != want_bytes:
            raise ValueError(
                f"{path}: {size} bytes, expected {want_bytes} for {want_shape} {np.dtype(np_dtype).name}; "
                f"the shard is truncated or corrupted: re-run the extraction to redo it"
            )
        specs[field] = (path, np_dtype, tuple(want_shape))
    return specs
