"""The hidden-state store: what extraction writes and training reads (SPEC.md §1-2).

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
`dequantize_fp8` gives back `q * scale` (the loader does this on read). Schema
version 1 is every store without fp8; version 2 adds fp8 and its scale files, so
a reader that knows only version 1 refuses an fp8 store by its version, and the
bf16/fp16/fp32 stores written before fp8 existed stay readable unchanged.
On disk a store is a directory:

    manifest.json                    written last: its presence means "complete"
    shards/rank00000-shard00000/     one directory a shard, renamed into place when complete
        index.json                   its dtype, per-sequence lengths, file shapes and sha256 sums, the inputs' hash
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

Layer ids (SPEC §1): layer id `l` is the output of decoder layer `l`,
`0 <= l <= L-1`; in Hugging Face `outputs.hidden_states` that is
`hidden_states[l + 1]`.
"""

import bisect
import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

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

SCHEMA_VERSIONS = (1, 2)  # readable; the version of a store is Layout.schema_version
MANIFEST = "manifest.json"
INDEX = "index.json"
SHARDS_DIR = "shards"
TMP_SUFFIX = ".tmp"

LAYER_ID_CONVENTION = (
    "layer id l = output of decoder layer l = HF hidden_states[l+1] "
    "(hidden_states[0] is the embedding output); 0 <= l <= L-1; "
    "id L-1 is stored before the final norm, like `last`"
)

# name -> (numpy dtype on disk, torch dtype of the view)
DTYPES = {
    "bfloat16": (np.uint16, torch.bfloat16),
    "float16": (np.float16, torch.float16),
    "float32": (np.float32, torch.float32),
    "float8_e4m3fn": (np.uint8, torch.float8_e4m3fn),
}
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "float8_e4m3fn"}
FP8 = "float8_e4m3fn"
FP8_MAX = 448.0  # largest finite e4m3fn value
# fp8 stores hold each of these fields with a per-token fp32 scale (one per layer for `hidden`).
SCALE_FIELDS = {"hidden": "hidden_scale", "last": "last_scale"}
# What the loader dequantises fp8 to: the bytes a bf16 store would hand the trainer.
FP8_READ_DTYPE = torch.bfloat16

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
    optional={"schema_version": INT, "dtype": STR, "job": STR, "inputs_sha256": STR},
)

# Final-norm kinds a store can describe: y = rms(x) * w, or zero-centred y = rms(x) * (1 + w).
NORM_KINDS = ("rmsnorm", "rmsnorm_zero_centred")


# ---------------------------------------------------------------- layer ids


def default_layer_ids(num_layers: int, num_tapped: int = 5) -> List[int]:
    """`num_tapped` ids spread uniformly from layer 1 to layer `num_layers - 3`, rounded.

    36 -> [1, 9, 17, 25, 33]; 64 -> [1, 16, 31, 46, 61]. One tapped layer is
    the middle one. Raises when the target is too shallow for distinct ids.
    """
    if num_tapped < 1:
        raise ValueError(f"num_tapped must be >= 1, got {num_tapped}")
    if num_tapped == 1:
        return [num_layers // 2]
    start, end = 1, num_layers - 3
    ids = [int(round(start + i * (end - start) / (num_tapped - 1))) for i in range(num_tapped)]
    if end <= start or len(set(ids)) != num_tapped:
        raise ValueError(
            f"cannot spread {num_tapped} distinct layer ids over 1..{end} of a {num_layers}-layer target; "
            f"pass fewer (--num-tapped) or explicit ids (--layer-ids)"
        )
    return ids


def check_layer_ids(layer_ids: Sequence[int], num_layers: int) -> List[int]:
    """Validate layer ids against a target of `num_layers` decoder layers; never clamp.

    Ids must be integers in 0..L-1, unique and sorted ascending. Returns them as a list.
    """
    ids = list(layer_ids)
    if not ids:
        raise ValueError("layer ids are empty: give at least one decoder layer id")
    for i in ids:
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
            raise ValueError(f"layer id {i!r} is not an integer")
        if i < 0:
            raise ValueError(
                f"layer id {i} is negative: ids count decoder layers from 0 "
                f"(the target has {num_layers}, ids 0..{num_layers - 1}); negative indexing is not allowed"
            )
        if i >= num_layers:
            raise ValueError(
                f"layer id {i} does not exist: the target has {num_layers} decoder layers "
                f"(ids 0..{num_layers - 1}); HF hidden_states[i+1] is layer i, and hidden_states[0] "
                f"is the embedding output, not a layer"
            )
    if len(set(ids)) != len(ids):
        raise ValueError(f"layer ids {ids} contain duplicates: each layer can be tapped once")
    if ids != sorted(ids):
        raise ValueError(f"layer ids {ids} are not sorted ascending: pass {sorted(ids)}")
    return [int(i) for i in ids]


def parse_layer_ids(text: str) -> List[int]:
    """'1,9,17' -> [1, 9, 17] (validated later against the target)."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--layer-ids {text!r}: expected comma-separated integers such as 1,9,17,25,33") from None


# ---------------------------------------------------------------- final norm


def final_norm_weight(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """The effective RMSNorm scale of a final norm of `kind`: `w`, or `1 + w` when zero-centred.

    weight: [H] -> [H]; use with `dflash_fast.eager.rms_norm(last, scale, eps)`.
    """
    if kind == "rmsnorm":
        return weight
    if kind == "rmsnorm_zero_centred":
        return 1 + weight
    raise ValueError(f"unknown final norm kind {kind!r}; expected one of {NORM_KINDS}")


# ---------------------------------------------------------------- layout


@dataclass(frozen=True)
class Layout:
    """Per-token shapes of every field; what the writer lays down and the reader expects."""

    num_tapped: int
    hidden_size: int
    topk: int
    dtype: str
    has_last: bool

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


def quantize_fp8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] -> (q [..., H] float8_e4m3fn, scale [...] float32): `scale = absmax / 448` over the last
    dimension, `q = x / scale` rounded to nearest (an all-zero vector gets scale 0 and q 0)."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / FP8_MAX
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (x / divisor[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = FP8_READ_DTYPE) -> torch.Tensor:
    """q [..., H] float8_e4m3fn, scale [...] -> `q * scale` [..., H] in `dtype` (product in fp32, one rounding).

    Error against the quantised x: at most 2^-4 |x| (e4m3's half ulp) + 2^-10 * scale (its subnormals),
    plus the rounding to `dtype` (2^-8 relative for bf16)."""
    return (q.float() * scale.float()[..., None]).to(dtype)


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


def _read_index(shard: str) -> dict:
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
    _fsync_dir(os.path.dirname(path))


def _fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- writer


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
        }
        write_json_atomic(os.path.join(self.tmp, INDEX), index)
        os.replace(self.tmp, self.final)
        _fsync_dir(os.path.dirname(self.final))

    def close(self) -> None:
        """Release file handles without committing (the `.tmp` directory stays, torn)."""
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


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
            index = _read_index(shard)
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
            _check_shard(shard, self.layout, index, expect=None)
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
            index = _read_index(shard)
            _check_shard(shard, self.layout, index, {k: entry[k] for k in ("num_sequences", "num_tokens")})
            # The index holds its files' sha256: the manifest's sum of the index closes the chain `verify` checks.
            shards.append({**entry, "index_sha256": sha256_file(os.path.join(shard, INDEX))})
        write_json_atomic(
            os.path.join(self.path, MANIFEST),
            {"schema_version": self.layout.schema_version, **manifest, "shards": shards},
        )
        HiddenStateStore(self.path)


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


# ---------------------------------------------------------------- shard checks and the reader


def _check_shard(shard: str, layout: Layout, index: dict, expect: Optional[dict]) -> Dict[str, tuple]:
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


class HiddenStateStore:
    """Memory-mapped reader of a store directory written by `dflash-fast extract`.

    `store[i]` -> dict of torch tensors (views of the mapped files; see the
    module docstring for names, shapes and dtypes). `store.lengths` [N] int64
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
        self.layout = Layout(len(m["layer_ids"]), m["hidden_size"], m["topk"], m["dtype"], m["has_last"])
        if version != self.layout.schema_version:
            raise ValueError(
                f"{manifest_path}: schema version {version} with dtype {m['dtype']} (a {m['dtype']} store is version "
                f"{self.layout.schema_version}); the manifest is corrupted"
            )
        self.hidden_dtype = DTYPES[m["dtype"]][1]
        self._specs = []
        lengths = []
        self.shard_dirs = shard_dirs(self.path, m["shards"], manifest_path)
        for shard, entry in zip(self.shard_dirs, m["shards"]):
            if not os.path.isdir(shard):
                raise FileNotFoundError(f"{shard}: shard listed in the manifest is missing")
            index = _read_index(shard)
            expect = {"num_sequences": entry["num_sequences"], "num_tokens": entry["num_tokens"]}
            self._specs.append(_check_shard(shard, self.layout, index, expect))
            lengths.append(np.asarray(index["lengths"], dtype=np.int64))
        self.lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
        if len(self.lengths) != m["num_sequences"] or int(self.lengths.sum()) != m["num_tokens"]:
            raise ValueError(
                f"{manifest_path}: shards hold {len(self.lengths)} sequences / {int(self.lengths.sum())} tokens, "
                f"the manifest says {m['num_sequences']} / {m['num_tokens']}; the store is inconsistent"
            )
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
        files = _read_index(shard)["files"]
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
