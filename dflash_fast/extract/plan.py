"""An extraction job, planned and validated before the model loads: the options (ExtractOptions; of them the
ExtractSettings, which an online source shares), the layer ids against the target's config, this rank's tokenized
JSONL records, the store layout, the shards and batches, and the job's identity (what makes two runs the same
extraction, so a re-run resumes and a different one is refused).

`dflash-fast extract` (extract.py) runs a job into a store; the online mode (online.py) runs the same job's
target inside training, with nothing written.
"""

import hashlib
import json
import os
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional, Sequence

import torch

from dflash_fast.extract.capture import TargetRunner
from dflash_fast.store.format import DTYPE_ALIASES, Layout, build_manifest, normalise_dtype
from dflash_fast.store.layer_ids import check_layer_ids, default_layer_ids
from dflash_fast.target.load import check_target, config_sha256
from dflash_fast.target.records import REASONING_MODES, ChatTokenizer, Example, InputStats, read_examples


def plan_shards(lengths: Sequence[int], shard_tokens: int) -> List[range]:
    """Consecutive sequences, cut before a shard would exceed `shard_tokens` (a shard holds >= 1 sequence)."""
    shards, start, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and tokens + n > shard_tokens:
            shards.append(range(start, i))
            start, tokens = i, 0
        tokens += n
    if start < len(lengths):
        shards.append(range(start, len(lengths)))
    return shards


def plan_batches(lengths: Sequence[int], batch_tokens: int) -> List[List[int]]:
    """Group indices so that (batch size x longest length) <= batch_tokens; longest first, so an
    out-of-memory shows in the first batch. A sequence longer than the budget runs alone."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[current[0]] > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def _launcher_env(rank, world_size):
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    return rank, world_size


def _default_device():
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


# The store dtypes by the names `dflash-fast extract --dtype` and data.online.dtype take.
DTYPE_NAMES = tuple(DTYPE_ALIASES)


@dataclass(frozen=True)
class ExtractSettings:
    """How the target's forwards are cut and what of them is kept, the one definition of these settings: the
    `dflash-fast extract` flags of the same names (--max-seq-len, ...; ExtractOptions is these plus the rest of
    extract's) and the data.online.* keys of an online source (data/config.py's OnlineConfig is these plus the
    online source's own), so that online batches are those a store extracted with the same settings would give."""

    max_seq_len: int = 2048  # longer documents are truncated and counted
    batch_tokens: int = 16384  # padded tokens per target forward
    dtype: str = "bf16"  # hidden and `last` rounded as a store of this dtype holds them: bf16, fp16, fp32, fp8
    topk: int = 8  # teacher top-k kept per token
    parity_every: int = 50  # check lm_head(norm(last)) == logits on the first forward and every N
    skip_bad: bool = False  # skip and count malformed JSONL lines instead of failing

    def settings(self) -> Dict[str, Any]:
        """The settings by name (what ExtractOptions takes of them), without a subclass's own fields."""
        return {f.name: getattr(self, f.name) for f in fields(ExtractSettings)}


@dataclass(frozen=True)
class ExtractOptions(ExtractSettings):
    """Everything `dflash-fast extract` takes besides target, data and out (the CLI flags of the same names): its
    ExtractSettings, and the layer ids, `last`, the engine and the records read."""

    layer_ids: Optional[Sequence[int]] = None  # None: num_tapped ids spread over 1..L-3
    num_tapped: int = 5
    shard_tokens: Optional[int] = None  # None: about 1 GiB per shard
    no_last: bool = False
    trust_remote_code: bool = False
    engine: str = "hf"  # hf: transformers in this process; vllm: dflash_fast.extract.vllm_runner
    tensor_parallel_size: int = 1  # vllm only
    split: str = "train"  # a Hugging Face dataset's split (datasets_in); JSONL has none
    max_samples: Optional[int] = None  # read only the first N records (JSONL lines or dataset rows)
    reasoning: str = "train"  # records.REASONING_MODES: reasoning trained, in the context without loss, removed

    def __post_init__(self):
        if self.topk < 1:
            raise ValueError(f"topk must be >= 1 (the argmax is always kept), got {self.topk}")
        if self.parity_every < 1:
            raise ValueError(f"parity_every must be >= 1, got {self.parity_every}")
        if self.reasoning not in REASONING_MODES:
            raise ValueError(f"reasoning {self.reasoning!r}: choose one of {REASONING_MODES}")
        if self.tensor_parallel_size != 1 and self.engine != "vllm":
            raise ValueError("--tensor-parallel-size is the engine's: it needs --engine vllm")


@dataclass
class Job:
    """One extraction run on one rank, planned and validated before the model loads."""

    target: str
    data: Optional[str]
    out: Optional[str]
    options: ExtractOptions
    rank: int
    world_size: int
    device: torch.device
    compute_dtype: torch.dtype
    config: object  # the target's transformers config
    layer_ids: List[int]
    layout: Layout
    shard_tokens: int
    tokenizer: object
    examples: List[Example]
    stats: InputStats
    identity: dict  # what makes two runs the same extraction
    id: str  # sha256 of `identity`


def plan_job(target: str, data: Optional[str], out: Optional[str], options: ExtractOptions, device=None, rank=None,
             world_size=None) -> Job:
    """Check the layer ids against the target's config and tokenize this rank's JSONL records -> Job.
    `rank` / `world_size` default to the launcher's RANK / WORLD_SIZE; `out` is None when nothing is written
    (online training); `data` is None for a served target, which gets its documents with each request."""
    from transformers import AutoConfig, AutoTokenizer

    rank, world_size = _launcher_env(rank, world_size)
    check_target(target)
    device = torch.device(device) if device is not None else _default_device()
    dtype = normalise_dtype(options.dtype)
    compute_dtype = torch.bfloat16 if device.type == "cuda" and dtype != "float32" else torch.float32
    config = AutoConfig.from_pretrained(target, trust_remote_code=options.trust_remote_code)
    text_config = config.get_text_config()
    num_layers, vocab_size = text_config.num_hidden_layers, text_config.vocab_size
    layer_ids = options.layer_ids
    layer_ids = check_layer_ids(default_layer_ids(num_layers, options.num_tapped) if layer_ids is None else layer_ids,
                                num_layers)
    if options.topk > vocab_size:
        raise ValueError(f"topk {options.topk} exceeds the vocabulary size {vocab_size}")
    layout = Layout(len(layer_ids), text_config.hidden_size, options.topk, dtype, not options.no_last)
    shard_tokens = options.shard_tokens or max(1, (1 << 30) // layout.bytes_per_token())
    tokenizer = AutoTokenizer.from_pretrained(target, trust_remote_code=options.trust_remote_code)
    if data is None:  # a served target (serve_target.py): the documents come with each request
        examples, stats, data_sha = [], InputStats(), None
    else:
        examples, stats, data_sha = read_examples(
            data, ChatTokenizer(tokenizer, vocab_size, options.reasoning), options.max_seq_len, options.skip_bad, rank,
            world_size, options.split, options.max_samples,
        )
    identity = {
        "schema_version": layout.schema_version,
        "target_config_sha256": config_sha256(target),
        "data_sha256": data_sha,
        "layer_ids": layer_ids,
        "dtype": dtype,
        "compute_dtype": str(compute_dtype).replace("torch.", ""),
        "has_last": layout.has_last,
        "topk": options.topk,
        "max_seq_len": options.max_seq_len,
        "shard_tokens": shard_tokens,
        "world_size": world_size,
        # Only when not the default, so that the stores extracted before the option keep their job id.
        **({"reasoning": options.reasoning} if options.reasoning != "train" else {}),
    }
    job_id = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return Job(target, data, out, options, rank, world_size, device, compute_dtype, config, layer_ids, layout,
               shard_tokens, tokenizer, examples, stats, identity, job_id)


def job_manifest(job: Job, runner: "TargetRunner") -> dict:
    """The store's manifest before its shards are counted (rank 0 adds those when every rank is done)."""
    config, target = job.config, job.target
    return build_manifest(
        target={
            "path": os.path.abspath(target) if os.path.isdir(target) else target,
            "config_sha256": job.identity["target_config_sha256"],
            "architectures": list(getattr(config, "architectures", None) or [type(runner.model).__name__]),
            "model_type": config.model_type,
        },
        num_layers=runner.num_layers,
        vocab_size=runner.vocab_size,
        layer_ids=job.layer_ids,
        layout=job.layout,
        compute_dtype=job.identity["compute_dtype"],
        final_norm={"kind": runner.norm_kind, "eps": runner.norm_eps, "module": runner.norm_name},
        extraction={
            "job": job.id,
            "engine": job.options.engine,
            "data": os.path.abspath(job.data) if os.path.exists(job.data) else job.data,  # else a hub id
            "reasoning": job.options.reasoning,  # extract --reasoning: what the model card tells of the data
            **{k: job.identity[k] for k in ("data_sha256", "max_seq_len", "shard_tokens", "world_size")},
        },
    )
