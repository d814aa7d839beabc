"""The data settings (the `data.*` keys of a training config): where the hidden states come from and how they are
cut into batches, the online target's settings, and their checks. The training config composes them
(dflash_fast/train/config.py); dflash_fast.data.source reads `data.source` as an object.
"""
import dataclasses
from typing import List, Optional

from dflash_fast.errors import check_config as _check
from dflash_fast.extract.plan import DTYPE_NAMES, ExtractSettings

DATA_SOURCES = ("store", "online", "vllm", "vllm_serve")


@dataclasses.dataclass(frozen=True)  # frozen as ExtractSettings is: a dataclass and its base agree on it
class OnlineConfig(ExtractSettings):
    """`data.source: online`: the target forward inside the training job. Its extraction settings (max_seq_len,
    batch_tokens, dtype, topk, parity_every, skip_bad) are dflash_fast.extract.plan.ExtractSettings, the definition
    `dflash-fast extract`'s flags of the same names come from too (the batches are those a store extracted with them
    would give); the fields below are the online source's own."""

    prefetch: bool = True  # run the next micro-batch's target forward on a side thread during this step
    # HOST:PORT of `dflash-fast serve-target` (same engine and settings): it runs the forwards; "": this process
    address: str = ""
    # data.source=vllm_serve (extract/vllm_serve.py, docs/engine-target.md): `vllm serve` replicas launched with the
    # hidden-state extraction flags, their --api-key, the hs_connectors transfer (file, fp8) and the seconds a
    # replica may stay silent before its requests go to the others
    servers: List[str] = dataclasses.field(default_factory=list)
    api_key: str = ""
    transfer: str = "file"
    request_timeout_s: float = 120.0


@dataclasses.dataclass
class DataConfig:
    """Where the hidden states come from and how they are cut into batches (dflash_fast.data.batches)."""

    # store: a directory written by `dflash-fast extract`; online: the target runs in the job; vllm: online, the
    # target run by vLLM in the job (extract --engine vllm's runner; docs/engine-target.md); vllm_serve: `vllm serve`
    # replicas at data.online.servers run it (extract/vllm_serve.py)
    source: str = "store"
    store: str = ""  # source=store
    # source=online: what `dflash-fast extract --data` reads (same formats and loss masks): JSONL or a Hugging Face
    # dataset (a save_to_disk directory, a .parquet / .arrow file, a hub id; docs/extraction.md)
    jsonl: str = ""
    split: str = "train"  # a Hugging Face dataset's split (data.jsonl)
    max_samples: int = 0  # read only the first N records of data.jsonl; 0: all
    # an assistant turn's reasoning in data.jsonl: train | mask (in the context, no loss) | drop (extract --reasoning)
    reasoning: str = "train"
    online: OnlineConfig = dataclasses.field(default_factory=OnlineConfig)
    seq_len: int = 3072  # T: tokens per packed row
    num_anchors: int = 512  # A: blocks per row
    batch_rows: int = 1  # R: rows per micro-batch on each rank
    val_fraction: float = 0.0  # documents held out for validation
    split_seed: int = 0
    num_workers: int = 2  # loader processes (source=store; online batches are built in the training process)
    noise_std: float = 0.0  # uniform noise on the hidden states (training only)


def check_data_source(d: DataConfig, target: Optional[str]) -> None:
    """The data.* keys' checks (ConfigError naming the key); `target`: model.target, which an online source runs."""
    _check(d.source in DATA_SOURCES, f"data.source={d.source!r} is not one of {DATA_SOURCES}")
    if d.source == "store":
        _check(bool(d.store),
               "data.store is not set: pass data.store=PATH (a directory written by `dflash-fast extract`), "
               "or data.source=online with data.jsonl=FILE")
    else:
        n = d.online
        _check(bool(d.jsonl), f"data.source={d.source} needs data.jsonl=FILE (the JSONL `dflash-fast extract` reads)")
        _check(bool(target), f"data.source={d.source} needs model.target (the target to run: a directory or hub id)")
        _check(n.dtype in DTYPE_NAMES, f"data.online.dtype={n.dtype!r} is not one of {DTYPE_NAMES}")
        _check(n.max_seq_len >= 2, f"data.online.max_seq_len={n.max_seq_len} must be >= 2")
        _check(n.batch_tokens >= 1 and n.topk >= 1 and n.parity_every >= 1,
               "data.online.batch_tokens, data.online.topk and data.online.parity_every must be >= 1")
        if n.address:
            from dflash_fast.extract.remote import parse_address

            parse_address(n.address)
        if d.source == "vllm_serve":
            from dflash_fast.extract.vllm_serve import TRANSFERS, parse_servers

            _check(bool(parse_servers(n.servers)), "data.source=vllm_serve needs data.online.servers=URL[,URL...] "
                   "(the `vllm serve` replicas, e.g. http://10.0.0.5:8000)")
            _check(n.transfer in TRANSFERS, f"data.online.transfer={n.transfer!r} is not one of {TRANSFERS}")
            _check(n.request_timeout_s > 0, f"data.online.request_timeout_s={n.request_timeout_s} must be > 0")
