"""The DeepSpeed training loop: `deepspeed train.py --config configs/<name>.yaml [key=value ...]`.

    store ──make_loader──▶ micro-batches ──drafter (DeepSpeed engine)──▶ loss ──backward──▶ AdamW or Muon (ZeRO 0-3)
    (data.source=online: JSONL ──the target's forward in this process, one micro-batch ahead──▶ micro-batches)
      every step:     metrics summed over micro-batches and ranks, then divided (SPEC §6)
      every N steps:  JSONL record, validation on the held-out split, checkpoint
      at the end:     checkpoint, validation, export (gated, dflash_fast/export.py) into OUT/export

One optimizer step is `schedule.grad_accum` micro-batches of `data.batch_rows`
rows on each rank. Its loss is the weighted mean over ALL valid slots of the
global batch (SPEC §5: sum(l * w * mask) / sum(mask)): before backward, each
micro-batch's loss is rescaled by its share of the step's global slot count,
so a step computes the same gradient however it is split into ranks and
micro-batches.

Run directory `output_dir` (OUT):

    OUT/config.yaml                  the resolved config
    OUT/metrics.jsonl                one record per `logging.every` steps ("split": "train") and per validation ("val")
    OUT/checkpoints/stepNNNNNNNN/    DeepSpeed's files, drafter.safetensors, rng_rankNNNNN.json and the completion
                                     marker dflash_fast.json (client state, every file's sha256): checkpoint.py
    OUT/export/                      the gated export (speculators layout, or zlab when only it serves the drafter)
    OUT/tensorboard/                 with logging.tensorboard=true

Without a launcher (`python train.py ...`) the run is a world of one process;
under `deepspeed` (or `torchrun`) every rank runs it. `train(cfg)` runs one job
in this process (tests run several); `main()` is the process entry point.
"""
import argparse
import json
import math
import os
import resource
import shutil
import signal
import socket
import sys
import time
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import yaml

from dflash_fast import ops
from dflash_fast.batches import derive_seed, make_loader, row_batches, steps_per_epoch
from dflash_fast.checkpoint import (
    CheckpointError,
    Sharing,
    checkpoint_tags,
    read_client_state,
    restore_rng_state,
    select_checkpoint,
    step_of,
    verify_checkpoint,
    write_marker,
    write_rng_state,
    write_weights,
)
from dflash_fast.config import DRAFTER_OPTIONS, ConfigError, ModelConfig, TrainConfig, load_config
from dflash_fast.drafter import DFlashDrafter, DrafterConfig, DrafterOutput, build_drafter, slot_metrics, slot_targets
from dflash_fast.eager import has_kl, needs_last
from dflash_fast.errors import DEBUG_ENV, UserError, run_reporting_errors
from dflash_fast.export import (
    ENGINES,
    ExportError,
    config_from_export,
    export_drafter,
    load_exported,
    read_export_config,
    servable_format,
)
from dflash_fast.extract import ExtractOptions
from dflash_fast.online import OnlineBatches, OnlineSource
from dflash_fast.store import HiddenStateStore, torch_dtype
from dflash_fast.target import check_target, config_sha256

# DeepSpeed JSON keys the YAML owns: one source of truth for every training hyperparameter.
YAML_OWNED = {
    "train_batch_size": "data.batch_rows and schedule.grad_accum",
    "train_micro_batch_size_per_gpu": "data.batch_rows",
    "gradient_accumulation_steps": "schedule.grad_accum",
    "gradient_clipping": "optimizer.grad_clip",
    "optimizer": "optimizer.*",
    "scheduler": "schedule.*",
    "bf16": "precision",
    "fp16": "precision",
}
_NOISE_STREAM = 101  # derive_seed stream tag of the hidden-state noise, apart from batches.py's tags


class StoreMismatch(ConfigError):
    """The store was extracted from a different target or with different layer ids than the drafter uses."""


class NonFiniteLoss(UserError):
    """A step produced a non-finite loss or gradient norm; nothing after the last good checkpoint is saved."""


# ---------------------------------------------------------------- checks before step 1

def resolve_loss_kind(kind: str, manifest: Dict) -> str:
    """`auto` -> `kl` (exact soft targets, one teacher matmul per slot) when the store has `last`,
    else `kl_topk` (the stored top-k teacher, no teacher matmul)."""
    if kind != "auto":
        return kind
    return "kl" if manifest["has_last"] else "kl_topk"


def check_store_matches(store_path: str, manifest: Dict, drafter: DrafterConfig, target: str, loss_kind: str) -> None:
    """Refuse a store whose manifest disagrees with the drafter (and its target), naming both values."""
    problems = []

    def compare(what: str, store_value, drafter_value, fix: str):
        if store_value != drafter_value:
            problems.append(f"{what}: the store has {store_value}, the drafter has {drafter_value} ({fix})")

    compare("layer ids", manifest["layer_ids"], drafter.layer_ids, "set model.layer_ids to the store's, or re-extract")
    compare("target hidden size", manifest["hidden_size"], drafter.target_hidden_size, "model.target is another model")
    compare("target decoder layers", manifest["num_layers"], drafter.target_num_layers, "model.target is another model")
    compare("vocabulary size", manifest["vocab_size"], drafter.vocab_size, "model.target is another model")
    compare("target fingerprint (sha256 of config.json)", manifest["target"]["config_sha256"], config_sha256(target),
            f"the store was extracted from {manifest['target']['path']}, the drafter is built from {target}")
    if problems:
        raise StoreMismatch(f"the store {store_path} does not match the drafter:\n  - " + "\n  - ".join(problems))
    if needs_last(loss_kind, stored_labels=True) and not manifest["has_last"]:  # every store holds the top-k
        raise StoreMismatch(f"loss.kind={loss_kind} needs `last`, but the store {store_path} was extracted with "
                            f"--no-last: use loss.kind=kl_topk (or ce), or re-extract without --no-last")


def deepspeed_config(path: str, cfg: TrainConfig, precision: str) -> Dict:
    """The DeepSpeed JSON at `path` (ZeRO, offload, communication) completed from the YAML."""
    try:
        with open(path) as f:
            ds = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"deepspeed={path}: file not found (ships: configs/ds_zero1.json, ds_zero2.json, "
                          f"ds_zero3.json, ds_zero3_offload.json)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"deepspeed={path} is not valid JSON: {e}") from None
    for key, owner in YAML_OWNED.items():
        if key in ds and ds[key] != "auto":
            raise ConfigError(f"{path} sets {key!r}; set {owner} in the YAML config instead (it owns that value)")
    ds = {k: v for k, v in ds.items() if k not in YAML_OWNED}
    ds.update(
        train_micro_batch_size_per_gpu=cfg.data.batch_rows,
        gradient_accumulation_steps=cfg.schedule.grad_accum,
        gradient_clipping=cfg.optimizer.grad_clip,
        bf16={"enabled": precision == "bf16"},
    )
    if cfg.optimizer.kind == "muon":
        _add_muon(ds, path, cfg)
    return ds


def _add_muon(ds: Dict, path: str, cfg: TrainConfig) -> None:
    """DeepSpeed's own Muon (`"optimizer": {"type": "Muon"}`): Muon on every trainable parameter whose layer shape
    is 2-D (DeepSpeed tags them `use_muon`), its auxiliary AdamW on the rest (the norm weights)."""
    o, zero = cfg.optimizer, ds.setdefault("zero_optimization", {})
    stage = zero.get("stage", 0)
    if stage == 0 and ds["bf16"]["enabled"]:
        raise ConfigError(f"{path}: optimizer.kind=muon under ZeRO-0 is supported in fp32 only (DeepSpeed's bf16 "
                          f"optimizer takes another Muon path, untested here): use configs/ds_zero1.json")
    if stage == 3 and zero.get("reduce_scatter") is True:
        raise ConfigError(f"{path} sets zero_optimization.reduce_scatter=true, which DeepSpeed's Muon cannot use "
                          f"under ZeRO-3: remove it (optimizer.kind=muon turns it off) or use optimizer.kind=adamw")
    if stage == 3:
        zero["reduce_scatter"] = False
    ds["optimizer"] = {
        "type": "Muon",
        "params": {
            "muon_lr": o.muon_lr,
            "momentum": o.muon_momentum,
            "adam_lr": o.lr,
            "betas": list(o.betas),
            "eps": o.eps,
            "weight_decay": o.weight_decay,
            # torch's AdamW for the auxiliary half (FusedAdam is a CUDA JIT build); an offloaded optimizer keeps
            # DeepSpeedCPUAdam, as under optimizer.kind=adamw.
            "torch_adam": not offloads_optimizer(ds),
        },
    }


def offloads_optimizer(ds: Dict) -> bool:
    device = ds.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    return device in ("cpu", "nvme")


def lr_multiplier(step: int, total: int, warmup: int, kind: str, min_ratio: float) -> float:
    """Learning-rate factor of update `step` (0-based): linear warmup reaching 1 at update warmup-1,
    then cosine from 1 down to min_ratio at the end (or constant 1)."""
    if step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def param_groups(drafter: DFlashDrafter, weight_decay: float) -> List[Dict]:
    """The trainable parameters: matrices (weight decay) and the rest (none)."""
    params = [p for p in drafter.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def build_optimizer(drafter: DFlashDrafter, cfg: TrainConfig, offload: bool) -> Optional[torch.optim.Optimizer]:
    """adamw: torch AdamW (nothing to JIT-compile); DeepSpeedCPUAdam when ZeRO offloads the optimizer to the CPU.
    muon: None, DeepSpeed builds its Muon from the JSON's optimizer section (deepspeed_config)."""
    o = cfg.optimizer
    if o.kind == "muon":
        return None
    groups = param_groups(drafter, o.weight_decay)
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=o.lr, betas=o.betas, eps=o.eps, adamw_mode=True)
    return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps)


def _layer_shape(p: torch.nn.Parameter) -> Tuple[int, ...]:
    """The shape the parameter has as a layer (under ZeRO-3 `p.shape` is that of a flat partition)."""
    return tuple(getattr(p, "ds_shape", p.shape))


def check_muon(engine) -> List[str]:
    """Refuse a DeepSpeed engine whose Muon would not orthogonalise every trainable matrix -> their names.

    DeepSpeed picks Muon per parameter by the shape it reads at initialize; a model built under `zero.Init`
    reads as 1-D there and would train on the auxiliary AdamW alone, without a word."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    basic = engine.basic_optimizer
    if not isinstance(basic, MuonWithAuxAdam):
        raise ConfigError(f"optimizer.kind=muon, but DeepSpeed built {type(basic).__name__}: the DeepSpeed JSON's "
                          f"optimizer section must be the one deepspeed_config writes")
    matrices, wrong = [], []
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        is_matrix = len(_layer_shape(p)) >= 2
        if is_matrix:
            matrices.append(name)
        # ZeRO routes a parameter (and the flat partition of its group) by this tag.
        if is_matrix != bool(getattr(p, "use_muon", False)):
            wrong.append(f"{name} {list(_layer_shape(p))} -> {'AdamW' if is_matrix else 'Muon'}")
    if wrong or not matrices:
        raise ConfigError("optimizer.kind=muon: DeepSpeed's Muon/AdamW split does not follow the layer shapes ("
                          + ("; ".join(wrong) or "no trainable matrix") + "); build the drafter outside zero.Init "
                          "or use optimizer.kind=adamw")
    return matrices


def check_muon_stepped(engine) -> None:
    """After the first ZeRO-0 step: refuse a Muon that left a trainable matrix without a momentum buffer.

    ZeRO-0 gives the optimizer whole matrices, and DeepSpeed releases that orthogonalise only ZeRO's flat partitions
    (0.19.8 does both) apply a plain SGD step to them, keeping no Muon state."""
    state = engine.basic_optimizer.state
    missing = [name for name, p in engine.module.named_parameters()
               if p.requires_grad and p.dim() >= 2 and "momentum_buffer" not in state.get(p, {})]
    if missing:
        raise ConfigError(f"optimizer.kind=muon under ZeRO-0: DeepSpeed's Muon did not orthogonalise "
                          f"{', '.join(missing)} (no momentum buffer after a step: SGD); use configs/ds_zero1.json")


# ---------------------------------------------------------------- distributed set-up

def free_port() -> int:
    """A TCP port free on this host now (for a one-process world or a launcher's --master_port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> Tuple[int, int]:
    """torch.distributed through DeepSpeed for the launcher's ranks, or a world of one when no launcher
    set RANK -> (rank, world size). The group lives as long as the process (DeepSpeed caches groups
    made from it), so several runs in one process share it."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(
                RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
            )
        if torch.cuda.is_available():
            get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", 0)))
        deepspeed.init_distributed(auto_mpi_discovery=False, verbose=False)
    return dist.get_rank(), dist.get_world_size()


def _quiet_deepspeed() -> None:
    import logging

    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+`? is deprecated", category=FutureWarning)


# ---------------------------------------------------------------- data and sums


def open_source(cfg: TrainConfig):
    """The hidden states: the store at data.store, or with data.source=online the target run over data.jsonl
    in this process (an OnlineSource, read like a store)."""
    d = cfg.data
    if d.source == "store":
        return HiddenStateStore(d.store)
    n = d.online
    options = ExtractOptions(
        layer_ids=cfg.model.layer_ids,
        max_seq_len=n.max_seq_len,
        batch_tokens=n.batch_tokens,
        dtype=n.dtype,
        topk=n.topk,
        # auto is kl when `last` exists; ce reads the top-k argmax the online source computes too
        no_last=not (cfg.loss.kind == "auto" or needs_last(cfg.loss.kind, stored_labels=True)),
        skip_bad=n.skip_bad,
        parity_every=n.parity_every,
    )
    try:
        return OnlineSource(cfg.model.target, d.jsonl, options)
    except (OSError, ValueError) as e:  # bad data or a missing file: exit 1, with the keys that named them
        raise ValueError(f"data.source=online over data.jsonl={d.jsonl} with model.target={cfg.model.target}: {e}") \
            from None


def open_batches(store, cfg: TrainConfig, rank: int, world_size: int, split: str, with_last: bool, epoch: int = 0,
                 start_step: int = 0):
    """This rank's batch dicts of one epoch of `split` from `start_step` on: a DataLoader over the store, or
    online an OnlineBatches (the target forward one micro-batch ahead; close() it)."""
    d = cfg.data
    args = (store, d.seq_len, d.num_anchors, d.batch_rows, cfg.seed, rank, world_size, epoch, split)
    kwargs = dict(start_step=start_step, val_fraction=d.val_fraction, split_seed=d.split_seed, with_last=with_last)
    if d.source == "online":
        return OnlineBatches(store, row_batches(*args, **kwargs), d.online.prefetch)
    return iter(make_loader(*args, num_workers=d.num_workers, **kwargs))


class TrainStream:
    """This rank's training micro-batches, epoch after epoch. `position` = (epoch, next micro-batch index).
    Online, `take_target_seconds()` is the target-forward time of the micro-batches handed out since the last call
    (None from a store)."""

    def __init__(
        self, store, cfg: TrainConfig, rank: int, world_size: int, with_last: bool, epoch: int = 0, index: int = 0
    ):
        self.store, self.cfg, self.rank, self.world_size, self.with_last = store, cfg, rank, world_size, with_last
        d = cfg.data
        self.per_epoch = steps_per_epoch(
            store, d.seq_len, d.batch_rows, cfg.seed, world_size, "train", d.val_fraction, d.split_seed
        )
        self.epoch, self.index = epoch, index
        self._it = None
        self._target_seconds = None if cfg.data.source == "store" else 0.0

    def __next__(self) -> Dict[str, torch.Tensor]:
        if self.index >= self.per_epoch:
            self.close()
            self.epoch, self.index = self.epoch + 1, 0
        if self._it is None:
            self._it = open_batches(self.store, self.cfg, self.rank, self.world_size, "train", self.with_last,
                                    self.epoch, self.index)
        self.index += 1
        batch = next(self._it)
        if isinstance(self._it, OnlineBatches):
            self._target_seconds += self._it.take_target_seconds()
        return batch

    def take_target_seconds(self) -> Optional[float]:
        seconds = self._target_seconds
        if seconds is not None:
            self._target_seconds = 0.0
        return seconds

    @property
    def position(self) -> Tuple[int, int]:
        return self.epoch, self.index

    def close(self):
        if isinstance(self._it, OnlineBatches):
            self._it.close()
        self._it = None


class Sums:
    """Sums that ranks add together before anything is divided (SPEC §6).

    loss_sum = sum(l * w * mask), kl_sum likewise, slots = sum(mask); acc_hits/acc_count/alpha_sum [B];
    tau_sum, blocks; tokens (row positions), anchors (valid); nonfinite, stop: flags (> 0 on any rank).
    """

    NAMES = ("loss_sum", "kl_sum", "slots", "tau_sum", "blocks", "tokens", "anchors", "nonfinite", "stop")

    def __init__(self, block_size: int, device):
        self.b = block_size
        self.v = torch.zeros(len(self.NAMES) + 3 * block_size, dtype=torch.float64, device=device)

    def __getitem__(self, name: str) -> float:
        return float(self.v[self.NAMES.index(name)])

    def add(self, name: str, value) -> None:
        self.v[self.NAMES.index(name)] += value

    def add_output(self, out: DrafterOutput, batch: Dict[str, torch.Tensor]) -> None:
        """One forward's contribution; loss and kl come back from their mean over max(slots, 1)."""
        n = len(self.NAMES)
        count = out.slot_mask.sum()
        denom = count.clamp(min=1).double()
        self.add("loss_sum", out.loss.detach().double() * denom)
        if out.kl is not None:
            self.add("kl_sum", out.kl.detach().double() * denom)
        self.add("slots", count)
        m = slot_metrics(out)
        self.v[n : n + self.b] += m["acc_hits"].double()
        self.v[n + self.b : n + 2 * self.b] += m["acc_count"].double()
        self.v[n + 2 * self.b :] += m["alpha_sum"].double()
        self.add("tau_sum", m["tau_sum"])
        self.add("blocks", m["blocks"])
        self.add("tokens", batch["input_ids"].numel())
        self.add("anchors", batch["anchor_valid"].sum())
        self.add("nonfinite", (~torch.isfinite(out.loss.detach())).double())

    def merge(self, other: "Sums") -> None:
        self.v += other.v

    def all_reduce(self) -> "Sums":
        dist.all_reduce(self.v)
        return self

    def metrics(self, with_kl: bool) -> Dict[str, Optional[float]]:
        """loss, kl (kinds with a soft teacher), acc_1..acc_{B-1} and alpha_1..alpha_{B-1} (mean acceptance
        estimate per slot; None where no slot was valid), tau_offline."""
        n = len(self.NAMES)
        slots = max(self["slots"], 1.0)
        out = {"loss": self["loss_sum"] / slots}
        if with_kl:
            out["kl"] = self["kl_sum"] / slots
        hits, counts, alphas = self.v[n:].view(3, self.b).tolist()
        for j in range(1, self.b):
            out[f"acc_{j}"] = hits[j] / counts[j] if counts[j] else None
        for j in range(1, self.b):
            out[f"alpha_{j}"] = alphas[j] / counts[j] if counts[j] else None
        out["tau_offline"] = self["tau_sum"] / self["blocks"] if self["blocks"] else None
        return out


class Window:
    """What the steps since the last metrics record add up to: their Sums, seconds per phase, wall seconds."""

    def __init__(self, block_size: int, device):
        self.sums, self.phase_seconds, self.steps, self.seconds = Sums(block_size, device), {}, 0, 0.0

    def add(self, sums: Sums, phase_seconds: Dict[str, float], seconds: float) -> None:
        self.sums.merge(sums)
        self.steps += 1
        self.seconds += seconds
        for phase, value in phase_seconds.items():
            self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + value

    def metrics(self, with_kl: bool) -> Dict[str, Optional[float]]:
        """SPEC §6 metrics of the window, throughput, and mean milliseconds per phase and per step."""
        return {
            **self.sums.metrics(with_kl),
            "tokens_per_s": self.sums["tokens"] / self.seconds,
            "anchors_per_s": self.sums["anchors"] / self.seconds,
            **{f"time_{phase}_ms": 1e3 * value / self.steps for phase, value in self.phase_seconds.items()},
            "step_time_ms": 1e3 * self.seconds / self.steps,
        }


def _peak_memory_mb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# ---------------------------------------------------------------- the trainer


class Trainer:
    """Builds everything from a validated config; `run()` trains, checkpoints, validates and exports."""

    def __init__(self, cfg: TrainConfig, rank: int, world_size: int):
        import deepspeed

        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.out_dir = cfg.output_dir
        self.checkpoints_dir = os.path.join(self.out_dir, "checkpoints")
        self.stop_signal: Optional[str] = None
        ops.set_backend(cfg.kernels)

        self.store = open_source(cfg)  # online: an OnlineSource, read like a store
        manifest = self.store.manifest
        d, s = cfg.data, cfg.schedule
        self.data_identity = {
            "store_tokens": manifest["num_tokens"],
            "store_job": manifest.get("extraction", {}).get("job"),
            "seq_len": d.seq_len,
            "num_anchors": d.num_anchors,
            "batch_rows": d.batch_rows,
            "grad_accum": s.grad_accum,
            "world_size": world_size,
            "seed": cfg.seed,
            "val_fraction": d.val_fraction,
            "split_seed": d.split_seed,
        }
        resume = self._find_resume()
        self.target = cfg.model.target or manifest["target"]["path"]
        self.loss_kind = resolve_loss_kind(cfg.loss.kind, manifest)
        # Every store holds the teacher's top-k, so only kl reads `last` (ce takes the stored argmax).
        self.with_last = needs_last(self.loss_kind, stored_labels=True)
        m = cfg.model
        self.precision = cfg.precision
        if self.precision == "auto":
            self.precision = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
        self.dtype = torch.bfloat16 if self.precision == "bf16" else torch.float32
        torch.manual_seed(cfg.seed)
        if m.init_from:
            drafter = self._init_from(m.init_from, self.store.path, manifest)
        else:
            try:
                check_target(self.target)
                # The frozen embedding and lm_head are [V, H] each: loaded in the compute dtype, never as an fp32 copy.
                drafter = build_drafter(
                    self.target,
                    m.layer_ids or manifest["layer_ids"],
                    m.mask_token_id,
                    norm_kind=manifest["final_norm"]["kind"],
                    frozen_dtype=self.dtype,
                    **m.drafter_options(),
                )
            except (OSError, ValueError, KeyError) as e:
                raise ConfigError(
                    f"cannot build the drafter from target {self.target!r} (model.target, default: the store's "
                    f"target; model.mask_token_id sets the mask token): {e}"
                ) from None
            check_store_matches(self.store.path, manifest, drafter.config, self.target, self.loss_kind)
        self.export_format = None
        if cfg.export:
            try:
                self.export_format = servable_format(drafter.config)
            except ExportError as e:
                raise ConfigError(f"{e}\nthis run ends with an export that no serving engine would serve as it "
                                  f"trained: change the drafter, or set export=false") from None
        self.block_size, self.sample_from_anchor = drafter.config.block_size, drafter.config.sample_from_anchor

        ds = deepspeed_config(cfg.deepspeed, cfg, self.precision)
        # No register_external_parameter for fc, hidden_norm and norm (read by DFlashDrafter.forward, not by their
        # own forward): ZeRO-3 detects such reads and gathers the parameters itself.
        self.zero_stage = ds.get("zero_optimization", {}).get("stage", 0)
        num_params = sum(p.numel() for p in drafter.parameters())

        self.stream = TrainStream(self.store, cfg, rank, world_size, with_last=self.with_last)
        self.total_steps = s.steps or math.ceil(s.epochs * self.stream.per_epoch / s.grad_accum)
        warmup = round(s.warmup_ratio * self.total_steps)
        optimizer = build_optimizer(drafter, cfg, offloads_optimizer(ds))

        def scheduler(basic_optimizer):  # DeepSpeed calls it with the optimizer it built (Muon) or was given
            return torch.optim.lr_scheduler.LambdaLR(
                basic_optimizer, lambda k: lr_multiplier(k, self.total_steps, warmup, s.kind, s.min_lr_ratio)
            )

        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=drafter,
            optimizer=optimizer,
            model_parameters=param_groups(drafter, cfg.optimizer.weight_decay) if optimizer is None else None,
            lr_scheduler=scheduler,
            config=ds,
        )
        self.muon_unchecked = cfg.optimizer.kind == "muon" and self.zero_stage == 0
        optimizer_line = "AdamW"
        if cfg.optimizer.kind == "muon":
            matrices = check_muon(self.engine)
            optimizer_line = f"Muon on {len(matrices)} matrices (fc and the layers' projections), AdamW on the norms"
        self.device = self.engine.device
        self.step = 0
        self.last_checkpoint: Optional[str] = None
        if resume is not None:
            self._resume(*resume)
        self.log(
            f"store {self.store.path}: {len(self.store)} documents, {manifest['num_tokens']:,} tokens, layer ids "
            f"{manifest['layer_ids']}; target {self.target}"
        )
        self.log(
            f"drafter: {num_params:,} trainable parameters, {m.num_layers} layers, "
            f"block {self.block_size}; loss {self.loss_kind}; {optimizer_line}; {self.precision}; "
            f"ZeRO-{self.zero_stage}; kernels "
            + ", ".join(f"{op}={ops.backend_of(op)}" for op in ops.OPS)
        )
        self.log(
            f"{world_size} rank(s) x {s.grad_accum} micro-batch(es) x {d.batch_rows} row(s) of "
            f"{d.seq_len} tokens per step; "
            f"{self.stream.per_epoch} micro-batches per epoch per rank; {self.total_steps} steps"
        )
        self._prepare_output()

    def _init_from(self, path: str, store_path: str, manifest: Dict) -> DFlashDrafter:
        """The drafter of the export at `path` (model.init_from) with the target's frozen tensors. Refused, before
        any tensor is read, when it does not match the store or a model.* key set to other than its default."""
        from transformers import AutoConfig

        m = self.cfg.model
        try:
            d = config_from_export(read_export_config(path), AutoConfig.from_pretrained(check_target(self.target)))
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"model.init_from={path}: {e}") from None
        try:
            check_store_matches(store_path, manifest, d, self.target, self.loss_kind)
        except StoreMismatch as e:
            raise StoreMismatch(
                f"model.init_from={path}: the export's drafter was made for other layer ids or another target "
                f"(extract a store with its layer ids, or start from a drafter made for this target): {e}"
            ) from None
        defaults = ModelConfig()
        theirs = {key: getattr(d, key) for key in ("layer_ids", "mask_token_id", *DRAFTER_OPTIONS)}
        for key, value in theirs.items():
            ours = getattr(m, key)
            if ours == getattr(defaults, key):
                continue
            if (ours if key != "causal_in_block" else [ours] * d.num_layers) != value:
                raise ConfigError(
                    f"model.init_from={path} fixes the drafter: model.{key}={ours} but the export has {value}; "
                    f"drop model.{key} (or give the export's value)"
                )
        try:
            drafter = load_exported(path, self.target, manifest["final_norm"]["kind"], frozen_dtype=self.dtype)
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"model.init_from={path}: {e}") from None
        self.log(f"drafter initialised from the export {path}")
        return drafter

    # ---- output

    def log(self, message: str) -> None:
        if self.rank == 0:
            from tqdm import tqdm

            tqdm.write(f"[dflash-fast] {message}", file=sys.stdout)
            sys.stdout.flush()

    def _prepare_output(self) -> None:
        self.metrics_path = os.path.join(self.out_dir, "metrics.jsonl")
        self.tensorboard = None
        if self.rank == 0:
            os.makedirs(self.out_dir, exist_ok=True)
            with open(os.path.join(self.out_dir, "config.yaml"), "w") as f:
                yaml.safe_dump(self.cfg.to_dict(), f, sort_keys=False)
            kept = []
            if self.step and os.path.exists(self.metrics_path):
                with open(self.metrics_path) as f:
                    kept = [line for line in f if json.loads(line)["step"] <= self.step]
            with open(self.metrics_path, "w") as f:
                f.writelines(kept)
            if self.cfg.logging.tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self.tensorboard = SummaryWriter(os.path.join(self.out_dir, "tensorboard"))

    def record(self, entry: Dict) -> None:
        if self.rank != 0:
            return
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(entry) + "\n")
        if self.tensorboard is not None:
            for key, value in entry.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tensorboard.add_scalar(f"{entry['split']}/{key}", value, entry["step"])

    # ---- checkpoints

    def _sharing(self) -> Sharing:
        """How this job's ranks split a checkpoint's sha256 work (every rank calls what takes it)."""

        def gather(obj):
            out = [None] * self.world_size
            dist.all_gather_object(out, obj)
            return out

        return Sharing(self.rank, self.world_size, gather)

    def _master_weights(self) -> Optional[Dict[str, torch.Tensor]]:
        """The fp32 master weights by name, gathered from every ZeRO partition; rank 0 gets them, the others None.
        A collective: every rank calls it."""
        from deepspeed.utils import safe_get_full_fp32_param

        weights = {}
        for name, p in self.engine.module.named_parameters():
            full = safe_get_full_fp32_param(p)
            if self.rank == 0:
                weights[name] = (p if full is None else full).detach().to("cpu", torch.float32, copy=True)
        return weights if self.rank == 0 else None

    def save(self) -> None:
        tag = f"step{self.step:08d}"
        path = os.path.join(self.checkpoints_dir, tag)
        epoch, index = self.stream.position
        client = {
            "step": self.step,
            "epoch": epoch,
            "micro_batch": index,
            "data": self.data_identity,
            "drafter": self.engine.module.config.to_dict(),
            "verifier": self.target,
            "loss_kind": self.loss_kind,
            "config": self.cfg.to_dict(),
        }
        if self.rank == 0 and os.path.isdir(path):
            shutil.rmtree(path)  # a save of this step that never finished (killed): its files would mix with ours
        dist.barrier()
        self.engine.save_checkpoint(self.checkpoints_dir, tag=tag)
        weights = self._master_weights()
        if self.rank == 0:
            write_weights(path, weights)
        write_rng_state(path, self.rank)
        dist.barrier()
        write_marker(path, client, self._sharing())
        self.last_checkpoint = path
        if self.rank == 0:
            for old in checkpoint_tags(self.checkpoints_dir)[: -self.cfg.checkpoint.keep_last]:
                shutil.rmtree(os.path.join(self.checkpoints_dir, old), ignore_errors=True)
        dist.barrier()
        self.log(f"checkpoint {self.last_checkpoint}")

    def _find_resume(self) -> Optional[Tuple[str, str, Dict]]:
        """The checkpoint to continue from -> (checkpoints dir, tag, client state), verified and checked before
        anything is built. DeepSpeed's loader unpickles its files, so a checkpoint whose files differ from the
        checksums its run recorded is refused (`latest`: the newest that verifies is taken, saying so)."""
        spec = self.cfg.checkpoint.resume
        tags = checkpoint_tags(self.checkpoints_dir)
        if spec is None:
            if tags:
                raise ConfigError(
                    f"{self.checkpoints_dir} already holds checkpoints ({tags[-1]}): pass --resume to continue "
                    f"that run, or choose another output_dir"
                )
            return None
        if spec == "latest" and not tags:
            self.log(f"--resume: no checkpoint in {self.checkpoints_dir} yet, starting from step 0")
            return None
        try:
            load_dir, tag = select_checkpoint(
                self.checkpoints_dir if spec == "latest" else spec, self.log, self._sharing()
            )
        except CheckpointError as e:
            raise ConfigError(f"checkpoint.resume={spec}: {e}") from None
        client = read_client_state(load_dir, tag)
        for key, now in self.data_identity.items():
            if client["data"].get(key) != now:
                raise ConfigError(
                    f"cannot resume {os.path.join(load_dir, tag)}: {key} was {client['data'].get(key)!r}, now {now!r}; "
                    f"the data position would not line up: restore it, or start a fresh output_dir"
                )
        return load_dir, tag, client

    def _resume(self, load_dir: str, tag: str, client: Dict) -> None:
        loaded, _ = self.engine.load_checkpoint(
            load_dir, tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if loaded is None:
            raise ConfigError(f"DeepSpeed could not load the checkpoint {os.path.join(load_dir, tag)}")
        self.step = client["step"]
        self.stream = TrainStream(
            self.store,
            self.cfg,
            self.rank,
            self.world_size,
            self.stream.with_last,
            client["epoch"],
            client["micro_batch"],
        )
        restore_rng_state(os.path.join(load_dir, tag), self.rank)
        self.last_checkpoint = os.path.join(load_dir, tag)
        self._set_aside_newer_checkpoints()
        self.log(
            f"resumed from {self.last_checkpoint} at step {self.step} (epoch {client['epoch']}, "
            f"micro-batch {client['micro_batch']})"
        )

    def _set_aside_newer_checkpoints(self) -> None:
        """Checkpoints in OUT/checkpoints newer than the resumed step (they failed to verify, or an older one was
        resumed on purpose) belong to a future this run replaces: renamed to TAG.superseded, so that neither
        keep_last pruning nor a later --resume mistakes them for this run's."""
        if self.rank == 0:
            for tag in checkpoint_tags(self.checkpoints_dir):
                if step_of(tag) > self.step:
                    old = os.path.join(self.checkpoints_dir, tag)
                    os.replace(old, old + ".superseded")
                    self.log(f"{old} is newer than the resumed step {self.step}: renamed to {old}.superseded")
        dist.barrier()

    def _resume_hint(self) -> str:
        """Where a stopped run can continue from: its last checkpoint only if that verifies (a collective)."""
        if self.last_checkpoint is None:
            return "no checkpoint was saved before it"
        problems = verify_checkpoint(self.last_checkpoint, self._sharing())
        if not problems:
            return (
                f"the last good checkpoint is {self.last_checkpoint} (it verifies: every file matches its recorded "
                f"sha256; continue from it with --resume after lowering optimizer.lr or checking the store)"
            )
        return (
            f"the last checkpoint {self.last_checkpoint} does not verify ({'; '.join(problems)}); --resume "
            f"continues from the newest one that does"
        )

    # ---- steps

    def _to_device(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        out = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        for key in ("hidden", "last"):
            if key in out:
                out[key] = out[key].to(self.dtype)
        return out

    def _forward(self, batch: Dict[str, torch.Tensor], noise_std: float, seed: int) -> DrafterOutput:
        loss = self.cfg.loss
        return self.engine(
            batch,
            loss_kind=self.loss_kind,
            gamma=loss.gamma,
            noise_std=noise_std,
            seed=seed,
            weighting=loss.weighting,
            dpace_alpha=loss.dpace_alpha,
            confidence_alpha=loss.confidence_alpha,
        )

    def train_step(self) -> Tuple[Sums, Dict[str, float], Optional[float]]:
        """One optimizer step -> (sums reduced over ranks, seconds per phase, grad norm)."""
        from deepspeed.accelerator import get_accelerator

        sync = get_accelerator().synchronize
        gas = self.cfg.schedule.grad_accum
        times = dict.fromkeys(("fetch", "forward", "backward", "optimizer"), 0.0)
        t = time.perf_counter()
        micro = [next(self.stream) for _ in range(gas)]
        counts = [int(slot_targets(b, self.block_size, self.sample_from_anchor).slot_mask.sum()) for b in micro]
        total = torch.tensor(float(sum(counts)), dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        total = max(float(total), 1.0)
        times["fetch"] += time.perf_counter() - t
        target_seconds = self.stream.take_target_seconds()
        if target_seconds is not None:
            times["target_forward"] = target_seconds  # online; on the side thread, hidden by the steps before
        sums = Sums(self.block_size, self.device)
        for i, (batch, count) in enumerate(zip(micro, counts)):
            t = time.perf_counter()
            batch = self._to_device(batch)
            seed = derive_seed(self.cfg.seed, _NOISE_STREAM, self.step, self.rank, i) % 2**31
            out = self._forward(batch, self.cfg.data.noise_std, seed)
            sync()
            times["forward"] += time.perf_counter() - t
            t = time.perf_counter()
            # DeepSpeed divides by grad_accum and averages over ranks; this makes the step's gradient that of
            # sum(l * w * mask) / (global slot count).
            self.engine.backward(out.loss * (max(count, 1) * self.world_size * gas / total))
            sync()
            times["backward"] += time.perf_counter() - t
            t = time.perf_counter()
            self.engine.step()
            sync()
            times["optimizer"] += time.perf_counter() - t
            sums.add_output(out, batch)
        if self.muon_unchecked:
            check_muon_stepped(self.engine)
            self.muon_unchecked = False
        times["drafter"] = times["forward"] + times["backward"] + times["optimizer"]
        grad_norm = self.engine.get_global_grad_norm()
        grad_norm = None if grad_norm is None else float(grad_norm)
        if grad_norm is not None and not math.isfinite(grad_norm):
            sums.add("nonfinite", 1.0)
        sums.add("stop", float(self.stop_signal is not None))
        return sums.all_reduce(), times, grad_norm

    @torch.no_grad()
    def validate(self) -> Dict:
        loader = open_batches(self.store, self.cfg, self.rank, self.world_size, "val", self.with_last)
        sums = Sums(self.block_size, self.device)
        batches = 0
        try:
            for batch in loader:
                if self.cfg.validation.max_batches and batches >= self.cfg.validation.max_batches:
                    break
                batch = self._to_device(batch)
                sums.add_output(self._forward(batch, 0.0, 0), batch)
                batches += 1
        finally:
            if isinstance(loader, OnlineBatches):
                loader.close()
        sums.all_reduce()
        entry = {
            "split": "val",
            "step": self.step,
            **sums.metrics(has_kl(self.loss_kind)),
            "batches": batches * self.world_size,
        }
        self.record(entry)
        self.log(
            f"validation at step {self.step}: loss {entry['loss']:.4f}, tau_offline {entry['tau_offline'] or 0:.3f}"
        )
        return entry

    def export(self) -> Optional[str]:
        """Gather the 16-bit (or fp32) module weights from every ZeRO-3 partition; rank 0 writes OUT/export."""
        import deepspeed

        module = self.engine.module
        params = dict(module.named_parameters())
        state = None
        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None, enabled=self.zero_stage == 3):
            if self.rank == 0:
                state = {name: p.detach().to("cpu", copy=True) for name, p in params.items()}
        path = None
        if self.rank == 0:
            path = export_drafter(
                module,
                os.path.join(self.out_dir, "export"),
                self.target,
                torch_dtype(self.cfg.export_dtype),
                state_dict=state,
                fmt=self.export_format,
            )
            engines = " and ".join(ENGINES[self.export_format])
            self.log(f"exported the drafter to {path} ({self.export_format} format, {self.cfg.export_dtype}; gated: "
                     f"read back as {engines} read it, same architecture and logits)")
        dist.barrier()
        return path

    def _on_signal(self, signum, _frame) -> None:
        if self.stop_signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop without saving
        self.stop_signal = signal.Signals(signum).name

    def run(self) -> Dict:
        """Train to the last step (or a signal): -> {"step", "interrupted", "checkpoint", "export"}."""
        from tqdm import tqdm

        cfg = self.cfg
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        bar = tqdm(
            total=self.total_steps,
            initial=self.step,
            disable=self.rank != 0 or not cfg.logging.progress,
            unit="step",
            dynamic_ncols=True,
            file=sys.stdout,
        )
        window = Window(self.block_size, self.device)
        with_kl = has_kl(self.loss_kind)
        saved_at = self.step if self.last_checkpoint else None
        validated_at = None
        try:
            while self.step < self.total_steps:
                lr = self.optimizer.param_groups[0]["lr"]
                t = time.perf_counter()
                sums, times, grad_norm = self.train_step()
                seconds = time.perf_counter() - t
                self.step += 1
                if sums["nonfinite"]:
                    raise NonFiniteLoss(
                        f"non-finite loss or gradient norm at step {self.step} (loss {sums.metrics(False)['loss']}, "
                        f"grad norm {grad_norm}): stopped without saving; {self._resume_hint()}"
                    )
                window.add(sums, times, seconds)
                step_metrics = sums.metrics(False)
                bar.update(1)
                bar.set_postfix(
                    {
                        "loss": f"{step_metrics['loss']:.3f}",
                        "tau_offline": f"{step_metrics['tau_offline'] or 0:.2f}",
                        "tok/s": f"{sums['tokens'] / seconds:.0f}",
                    },
                    refresh=False,
                )
                if self.step % cfg.logging.every == 0 or self.step == self.total_steps:
                    epoch, index = self.stream.position
                    self.record(
                        {
                            "split": "train",
                            "step": self.step,
                            "epoch": epoch + index / self.stream.per_epoch,
                            **window.metrics(with_kl),
                            "lr": lr,
                            "grad_norm": grad_norm,
                            "peak_memory_mb": _peak_memory_mb(),
                        }
                    )
                    window = Window(self.block_size, self.device)
                if cfg.validation.every and self.step % cfg.validation.every == 0:
                    self.validate()
                    validated_at = self.step
                if sums["stop"]:
                    self.save()
                    self.log(f"stopped by a signal at step {self.step}; continue with --resume")
                    return {"step": self.step, "interrupted": True, "checkpoint": self.last_checkpoint, "export": None}
                if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0:
                    self.save()
                    saved_at = self.step
            bar.close()
            if saved_at != self.step:
                self.save()
            if cfg.data.val_fraction > 0 and validated_at != self.step:
                self.validate()
            export = self.export() if cfg.export else None
            return {"step": self.step, "interrupted": False, "checkpoint": self.last_checkpoint, "export": export}
        finally:
            bar.close()
            self.stream.close()
            if self.tensorboard is not None:
                self.tensorboard.close()
            for s, handler in previous.items():
                signal.signal(s, handler)


def train(cfg: TrainConfig) -> Dict:
    """Run one training job (this process is one rank); see Trainer.run for the result."""
    _quiet_deepspeed()
    return Trainer(cfg, *init_distributed()).run()


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="train.py",
        description="Train a DFlash drafter with DeepSpeed: "
        "deepspeed train.py --config configs/tiny.yaml [key.sub=value ...]",
    )
    p.add_argument("--config", help="YAML config, e.g. configs/tiny.yaml or configs/qwen3-8b.yaml")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in OUT/checkpoints "
        "(checkpoint.resume=PATH continues from another one)",
    )
    p.add_argument(
        "--local_rank", type=int, default=None, help=argparse.SUPPRESS
    )  # the deepspeed launcher's; LOCAL_RANK is used
    p.add_argument("--debug", action="store_true", help=f"show the traceback of an error (also: {DEBUG_ENV}=1)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides such as optimizer.lr=3e-4")
    return p.parse_intermixed_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The process entry point: a user error ends it in one `error: ...` line, exit 2 (config) or 1 (data, a
    non-finite loss); other exceptions keep their traceback (dflash_fast/errors.py)."""
    args = parse_args(argv)
    overrides = list(args.overrides) + (["checkpoint.resume=latest"] if args.resume else [])

    def run() -> None:
        train(load_config(args.config, overrides))

    ours = not dist.is_initialized()  # a caller's group (several runs in one process) is the caller's to destroy
    try:
        code = run_reporting_errors(run, args.debug)
    finally:
        if ours and dist.is_initialized():
            dist.destroy_process_group()
    if code:
        sys.exit(code)
