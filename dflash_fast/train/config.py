"""One typed config for a training run: a YAML file plus `key.sub=value` overrides, validated once.

    deepspeed train.py --config configs/qwen3-8b.yaml optimizer.lr=3e-4 data.store=/data/store

Every key has a default here; a YAML file or an override that names a key this
file does not define is refused by name. Values are converted to the declared
type (`6e-4` is a float even though YAML 1.1 reads it as a string; `1,9,17`
is a list of ints), then `validate` checks ranges and choices. Inner code
trusts the result. Relative paths are relative to the directory the run is
launched from, but for one: a relative `deepspeed` written in a YAML file is
relative to that file's directory (the DeepSpeed JSON belongs with the config
that names it: `configs/tiny.yaml` says `deepspeed: ds_zero1.json`), so a
config runs from any directory. Left unset, it is the shipped
configs/ds_zero2.json.
"""
import dataclasses
import difflib
import math
import os
import typing
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from dflash_fast.data.config import DataConfig, check_data_source
from dflash_fast.drafter.config import DrafterOptions
from dflash_fast.errors import ConfigError, read_mapping
from dflash_fast.errors import check_config as _check

SCHEDULES = ("cosine", "constant")
PRECISIONS = ("auto", "bf16", "fp32")
EXPORT_DTYPES = ("bf16", "fp16", "fp32")
OPTIMIZERS = ("adamw", "muon")
SHIPPED_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")


@dataclasses.dataclass
class ModelConfig(DrafterOptions):
    """The drafter: its architecture options (dflash_fast.drafter.config.DrafterOptions, the one definition of those
    keys and their defaults) and what the training run adds. Sizes, RoPE and the frozen embedding / lm_head / final
    norm come from the target."""

    target: Optional[str] = None  # target checkpoint directory or hub id; None = the one the store was extracted from
    layer_ids: Optional[List[int]] = None  # target layer ids the drafter taps; None = the store's
    mask_token_id: Optional[int] = None  # None: drafter/model.py resolve_mask_token_id (mask, unused row, pad/eos/unk)
    # An export directory (speculators or z-lab layout, ours or a published drafter) to continue training: it fixes
    # the architecture above (a key set to other than its default must agree with it) and the starting weights.
    init_from: Optional[str] = None
    # Keep only each drafter layer's input for the backward and recompute the layer there (torch.utils.checkpoint,
    # non-reentrant): the saved activations of all layers but one become one [Q, H] tensor each (docs/memory.md).
    activation_checkpointing: bool = False

    def drafter_options(self) -> Dict[str, Any]:
        """The architecture keys (`DRAFTER_OPTIONS`) as `DrafterConfig.from_target` takes them."""
        return self.options()


# The model.* keys that are the drafter's architecture options, named as DrafterConfig names them.
DRAFTER_OPTIONS = DrafterOptions.names()


@dataclasses.dataclass
class LossConfig:
    """`kind`: one of dflash_fast.drafter.losses.LOSS_KINDS, or `auto`: `kl` (exact soft targets from `last`) when the
    store has `last`, else `kl_topk`. `weighting` of the slots of a block (spec.md §5): `decay`, or `dpace`
    (D-PACE, from the drafter's own confidence against the teacher's argmax)."""

    kind: str = "auto"
    gamma: float = 7.0  # decay: position weight w_j = exp(-(j - 1) / gamma)
    weighting: str = "decay"  # decay | dpace
    dpace_alpha: float = 0.5  # dpace: confidence smoothing s_j = (1 - alpha) c_j + alpha, in [0, 1]
    confidence_alpha: float = 1.0  # DSpark: weight of the confidence head's BCE in the loss (model.confidence_head)
    selector_alpha: float = 1.0  # DFlash2: weight of the candidate selector's CE in the loss (model.selector_rank)
    # LiLiCorr (model.lilicorr_candidate_topk): ModelOpt's absolute weights of the lattice terms, its `base` variant
    # (`margin`: w_ce 0.125, w_margin 0.125, margin 2.0, w_pen 0.25); w_pen needs a dense kind (the teacher's logits)
    lilicorr_w_ce: float = 0.25
    lilicorr_w_margin: float = 0.0
    lilicorr_margin: float = 2.0
    lilicorr_w_pen: float = 0.25

    def family_weights(self) -> Dict[str, float]:
        """The weights of the families' loss terms, by the name each family's `family_terms` reads."""
        return {"confidence_alpha": self.confidence_alpha, "selector_alpha": self.selector_alpha,
                **{name: getattr(self, name) for name in LILICORR_WEIGHTS}}


# LiLiCorr's lattice-term weights (lilicorr.LiLiCorrDrafter.family_terms reads them by these names)
LILICORR_WEIGHTS = ("lilicorr_w_ce", "lilicorr_w_margin", "lilicorr_margin", "lilicorr_w_pen")


@dataclasses.dataclass
class OptimizerConfig:
    """`adamw`, or `muon`: DeepSpeed's Muon for the drafter's 2-D matrices (fc, attention and MLP projections)
    and its auxiliary AdamW (lr, betas, eps) for the norm weights. Weight decay applies to matrices only."""

    kind: str = "adamw"
    lr: float = 6e-4  # AdamW's; under muon the norm weights' (the matrices take muon_lr)
    muon_lr: float = 0.02  # spectral-norm units: one update moves each matrix by ~muon_lr * sqrt(max(1, rows / cols))
    muon_momentum: float = 0.95
    betas: Tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # global grad-norm clip; 0 = off


@dataclasses.dataclass
class ScheduleConfig:
    """Optimizer steps; one step = grad_accum micro-batches on every rank."""

    kind: str = "cosine"
    warmup_ratio: float = 0.04  # linear warmup over this fraction of the steps
    min_lr_ratio: float = 0.0  # cosine floor, as a fraction of optimizer.lr
    epochs: float = 1.0
    steps: int = 0  # total optimizer steps; 0 = epochs x steps per epoch
    grad_accum: int = 1


@dataclasses.dataclass
class LoggingConfig:
    every: int = 10  # steps per JSONL record (OUT/metrics.jsonl)
    tensorboard: bool = False  # also write OUT/tensorboard (needs the tensorboard package)
    wandb: bool = False  # also log to Weights & Biases (the wandb package; WANDB_MODE=offline: OUT/wandb)
    mlflow: bool = False  # also log to MLflow (the mlflow package; MLFLOW_TRACKING_URI says where)
    project: str = "dflash-fast"  # the W&B project / MLflow experiment of logging.wandb / logging.mlflow
    progress: bool = True  # rank-0 tqdm bar


@dataclasses.dataclass
class CheckpointConfig:
    every: int = 1000  # steps between checkpoints (OUT/checkpoints); 0 = only at the end and on SIGTERM
    keep_last: int = 2
    resume: Optional[str] = None  # "latest" (OUT/checkpoints), a checkpoints directory or one checkpoint; None = fresh


@dataclasses.dataclass
class ValidationConfig:
    every: int = 0  # steps between validations on the held-out split; 0 = only at the end
    max_batches: int = 0  # per rank and validation; 0 = the whole split
    # Real acceptance while training (docs/training.md): block speculative decoding of held-out prompts with the
    # drafter being trained, by `dflash-fast eval`'s loop on rank 0 (dflash_fast/evaluate/validation.py).
    prompts: str = ""  # prompts as `dflash-fast eval --data` reads them (JSONL or a dataset); "" = no real decoding
    decode_every: int = 0  # steps between real decodings; 0 = only at the end (with validation.prompts)
    num_prompts: int = 8  # the first N prompts
    max_new_tokens: int = 64  # new tokens per prompt
    temperature: float = 0.0  # > 0: also decode sampled at this temperature (spec.md §10), seeded by validation.seed
    seed: int = 0
    thinking: str = ""  # on | off: the chat template's thinking switch (eval --thinking); "": the template's default
    # At the end: warn when real drafted tokens per block, tau - 1, differ from the offline estimate's,
    # tau_offline - 1, by more than this fraction of the offline one (docs/troubleshooting.md)
    max_gap: float = 0.5


@dataclasses.dataclass
class TrainConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    validation: ValidationConfig = dataclasses.field(default_factory=ValidationConfig)
    kernels: str = "auto"  # dflash_fast.drafter.ops backend spec: auto | eager | triton | fc_concat=triton,...
    output_dir: str = "runs/dflash"
    # ZeRO / offload / communication settings only; relative to the YAML file that names it
    deepspeed: str = os.path.join(SHIPPED_CONFIGS, "ds_zero2.json")
    precision: str = "auto"
    seed: int = 0
    export: bool = True  # write OUT/export (speculators format) at the end
    export_dtype: str = "bf16"

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- loading


def _fields(cls) -> Dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _unknown(key: str, known: Sequence[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown config key {key!r} in {where}{hint} (known here: {', '.join(sorted(known))})")


def _coerce(value: Any, kind: Any, key: str) -> Any:
    """Convert `value` (from YAML or the command line) to the annotated type, or raise naming `key`."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is typing.Union:  # Optional[X]
        if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "~", "")):
            return None
        return _coerce(value, next(a for a in args if a is not type(None)), key)
    if origin in (list, tuple):
        if isinstance(value, str):
            value = [v for v in value.strip().strip("[]()").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        if origin is tuple:
            if len(value) != len(args):
                raise ConfigError(f"{key}: expected {len(args)} values, got {list(value)!r}")
            return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "yes", "on", "1", "false", "no", "off", "0"):
            return value.strip().lower() in ("true", "yes", "on", "1")
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if kind in (int, float):
        what, accepted = ("an integer", (int, str)) if kind is int else ("a number", (int, float, str))
        if isinstance(value, bool) or not isinstance(value, accepted):
            raise ConfigError(f"{key}: expected {what}, got {value!r}")
        try:
            return kind(value)
        except ValueError:
            raise ConfigError(f"{key}: expected {what}, got {value!r}") from None
    if kind is str:
        if isinstance(value, (dict, list)) or value is None:
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    raise TypeError(f"config field {key} has an unsupported type {kind}")


def _build(cls, data: Dict[str, Any], prefix: str, where: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'the config'} in {where} must be a mapping, got {data!r}")
    fields = _fields(cls)
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in fields:
            raise _unknown(full, list(fields), where)
        kind = fields[key]
        if dataclasses.is_dataclass(kind):
            kwargs[key] = _build(kind, value if value is not None else {}, f"{full}.", where)
        else:
            kwargs[key] = _coerce(value, kind, full)
    return cls(**kwargs)


def parse_overrides(overrides: Sequence[str]) -> Dict[str, Any]:
    """['optimizer.lr=3e-4', 'data.store=/x'] -> nested dict of raw strings (typed later)."""
    nested: Dict[str, Any] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not key=value (e.g. optimizer.lr=3e-4)")
        node = nested
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
        try:
            node[parts[-1]] = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError:
            node[parts[-1]] = value
    return nested


def _merge(base: Dict[str, Any], extra: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _deepspeed_beside(path: str, data: Dict[str, Any]) -> Dict[str, Any]:
    """`data` with a relative `deepspeed` resolved against the directory of the YAML file at `path`."""
    value = data.get("deepspeed")
    if not isinstance(value, str) or not value or os.path.isabs(value):
        return data
    here = os.path.dirname(os.path.abspath(path))
    resolved = os.path.join(here, value)
    if not os.path.exists(resolved):
        hint = (f": write deepspeed: {os.path.relpath(os.path.abspath(value), here)}"
                if os.path.exists(value) else "")
        raise ConfigError(f"{path}: deepspeed: {value} is {resolved}, which does not exist (a relative path in a "
                          f"config file is relative to the file's directory){hint}")
    return {**data, "deepspeed": resolved}


def load_config(path: Optional[str] = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """The YAML at `path` (or all defaults), then `overrides`, typed and validated."""
    data: Dict[str, Any] = {}
    if path is not None:  # an empty file is all defaults
        data = read_mapping(path, lambda f: yaml.safe_load(f) or {}, yaml.YAMLError, ConfigError, "YAML",
                            "a mapping of sections")
        data = _deepspeed_beside(path, data)
    cfg = _build(TrainConfig, data, "", path or "the defaults")
    if overrides:
        cfg = _build(TrainConfig, _merge(data, parse_overrides(overrides)), "", "the command-line overrides")
    validate(cfg)
    return cfg


def config_from_dict(data: Dict[str, Any]) -> TrainConfig:
    """A validated TrainConfig from a nested dict (e.g. a checkpoint's saved config)."""
    cfg = _build(TrainConfig, data, "", "a config dict")
    validate(cfg)
    return cfg


# ---------------------------------------------------------------- validation


def _numbers(node, prefix: str = ""):
    """(dotted key, value) of every float in a config, tuples (optimizer.betas) included."""
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from _numbers(value, f"{key}.")
        elif isinstance(value, (tuple, list)):
            yield from ((f"{key}[{i}]", v) for i, v in enumerate(value) if isinstance(v, float))
        elif isinstance(value, float):
            yield key, value


def validate(cfg: TrainConfig) -> None:
    """Ranges and choices, section by section; what needs the store or the target is checked by the trainer."""
    from dflash_fast.drafter import ops

    for key, value in _numbers(cfg):
        _check(math.isfinite(value), f"{key}={value} is not a finite number")
    check_data_source(cfg.data, cfg.model.target)
    _check_model(cfg.model)
    _check_rows(cfg.data, cfg.model)
    _check_heads_and_loss(cfg.model, cfg.loss)
    _check_optimizer(cfg.optimizer)
    _check_schedule_and_outputs(cfg)
    _check(bool(cfg.output_dir), "output_dir is empty")
    if cfg.checkpoint.resume is not None and cfg.checkpoint.resume.lower() in ("true", "false"):
        cfg.checkpoint.resume = "latest" if cfg.checkpoint.resume.lower() == "true" else None
    _check(bool(cfg.deepspeed), "deepspeed is empty: give a DeepSpeed JSON such as configs/ds_zero2.json")
    try:
        ops.parse_backends(cfg.kernels)
    except ValueError as e:
        raise ConfigError(f"kernels: {e}") from None
    if cfg.logging.tensorboard:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError:
            raise ConfigError(
                "logging.tensorboard=true needs the tensorboard package: pip install tensorboard"
            ) from None
    for key in ("wandb", "mlflow"):
        if getattr(cfg.logging, key):
            try:
                __import__(key)
            except ImportError:
                raise ConfigError(f"logging.{key}=true needs the {key} package: pip install {key} "
                                  f"(or set logging.{key}=false)") from None


def _check_model(m: ModelConfig) -> None:
    from dflash_fast.drafter.config import MAX_BLOCK_SIZE
    from dflash_fast.drafter.masks import WINDOW_RULES

    _check(m.num_layers >= 1, f"model.num_layers={m.num_layers} must be >= 1")
    _check(m.block_size >= 2, f"model.block_size={m.block_size} must be >= 2 (slot 0 is the given token)")
    _check(m.block_size <= MAX_BLOCK_SIZE,
           f"model.block_size={m.block_size} is beyond {MAX_BLOCK_SIZE} (dflash_fast.drafter.config.MAX_BLOCK_SIZE)")
    _check(m.mask_token_id is None or m.mask_token_id >= 0, f"model.mask_token_id={m.mask_token_id} must be >= 0")
    _check(m.sliding_window is None or m.sliding_window >= 1,
           f"model.sliding_window={m.sliding_window} must be >= 1 (or null: no sliding layer)")
    _check(
        m.layer_types is None or len(m.layer_types) == m.num_layers,
        f"model.layer_types has {len(m.layer_types or [])} entries for model.num_layers={m.num_layers}",
    )
    _check(
        m.layer_types is None or set(m.layer_types) <= {"full", "sliding"},
        f"model.layer_types={m.layer_types}: each entry is 'full' or 'sliding'",
    )
    _check(
        "sliding" not in (m.layer_types or []) or bool(m.sliding_window and m.sliding_window > 0),
        "model.layer_types has 'sliding' layers: set model.sliding_window > 0",
    )
    _check(m.window_from in WINDOW_RULES, f"model.window_from={m.window_from!r} is not one of {WINDOW_RULES}")
    _check(
        m.window_from != "query" or "sliding" not in (m.layer_types or []) or m.sliding_window >= m.block_size,
        f"model.window_from=query needs model.sliding_window >= model.block_size (the engines would window the "
        f"block's own keys too): got {m.sliding_window} < {m.block_size}",
    )


def _check_rows(d: DataConfig, m: ModelConfig) -> None:
    _check(
        d.seq_len >= m.block_size,
        f"data.seq_len={d.seq_len} cannot hold one anchor and its block of model.block_size={m.block_size} "
        f"tokens: set data.seq_len >= {m.block_size}",
    )
    _check(d.num_anchors >= 1, f"data.num_anchors={d.num_anchors} must be >= 1")
    # An anchor a needs a + 1 inside the row (spec.md §3): a row of T tokens holds at most T - 1 anchors, and each is
    # a block of B query rows in every layer, so anchors past that would only allocate padding.
    _check(
        d.num_anchors <= d.seq_len - 1,
        f"data.num_anchors={d.num_anchors} is more than a row of data.seq_len={d.seq_len} tokens can hold "
        f"({d.seq_len - 1} anchors: every anchor needs the next token in its row): lower data.num_anchors",
    )
    _check(d.batch_rows >= 1, f"data.batch_rows={d.batch_rows} must be >= 1")
    _check(0 <= d.val_fraction < 1, f"data.val_fraction={d.val_fraction} must be in [0, 1)")
    _check(d.num_workers >= 0, f"data.num_workers={d.num_workers} must be >= 0")
    _check(d.max_samples >= 0, f"data.max_samples={d.max_samples} must be >= 0 (0: every record)")
    from dflash_fast.target.records import REASONING_MODES

    _check(d.reasoning in REASONING_MODES,
           f"data.reasoning={d.reasoning!r} is not one of {', '.join(REASONING_MODES)} (docs/training.md)")
    _check(d.noise_std >= 0, f"data.noise_std={d.noise_std} must be >= 0")


def _check_heads_and_loss(m: ModelConfig, loss: LossConfig) -> None:
    from dflash_fast.drafter.config import MARKOV_HEAD_TYPES
    from dflash_fast.drafter.losses import DENSE_KINDS, LOSS_KINDS, WEIGHTINGS

    _check(m.markov_rank >= 0, f"model.markov_rank={m.markov_rank} must be >= 0 (0 = no Markov head)")
    _check(m.markov_head_type in MARKOV_HEAD_TYPES,
           f"model.markov_head_type={m.markov_head_type!r} is not one of {MARKOV_HEAD_TYPES}")
    _check(not (m.confidence_head and m.confidence_head_with_markov and m.markov_rank == 0),
           "model.confidence_head_with_markov=true needs the Markov head: set model.markov_rank > 0 "
           "(DSpark's default 256) or model.confidence_head_with_markov=false")
    _check(not m.confidence_head or loss.kind in ("auto",) + DENSE_KINDS,
           f"model.confidence_head=true trains against the acceptance rate sum_v min(q_v, p_v), which needs the full "
           f"teacher: loss.kind={loss.kind!r} has none; use one of {DENSE_KINDS} (a store with `last`)")
    _check(loss.confidence_alpha >= 0, f"loss.confidence_alpha={loss.confidence_alpha} must be >= 0")
    _check(loss.selector_alpha >= 0, f"loss.selector_alpha={loss.selector_alpha} must be >= 0")
    lattice = tuple(getattr(loss, name) for name in LILICORR_WEIGHTS)
    _check(min(lattice) >= 0 and (not loss.lilicorr_w_margin or loss.lilicorr_margin > 0),
           f"loss.lilicorr_w_ce, _w_margin, _margin, _w_pen={lattice} must be >= 0 (a margin > 0 with w_margin > 0)")
    _check(m.conv_kernel_size >= 0 and m.selector_rank >= 0,
           f"model.conv_kernel_size={m.conv_kernel_size} and model.selector_rank={m.selector_rank} must be >= 0 "
           f"(0 = without DFlash2's convolutions / selector)")
    _check(not m.conv_kernel_size or 1 <= m.conv_group_size,
           f"model.conv_group_size={m.conv_group_size} must be >= 1 (DFlash2's default 16)")
    _check(m.conv_kernel_size <= m.block_size,
           f"model.conv_kernel_size={m.conv_kernel_size} is more taps than a block has slots "
           f"(model.block_size={m.block_size})")
    _check(not m.selector_rank or m.selector_top_k >= 1, f"model.selector_top_k={m.selector_top_k} must be >= 1")
    _check(not ((m.conv_kernel_size or m.selector_rank) and (m.markov_rank or m.confidence_head)),
           "DFlash2 (model.conv_kernel_size, model.selector_rank) and DSpark (model.markov_rank, "
           "model.confidence_head) are two drafter families: set one family's keys")
    kinds = ("auto",) + LOSS_KINDS
    _check(loss.kind in kinds, f"loss.kind={loss.kind!r} is not one of {kinds}")
    _check(loss.gamma > 0, f"loss.gamma={loss.gamma} must be > 0")
    _check(loss.weighting in WEIGHTINGS, f"loss.weighting={loss.weighting!r} is not one of {WEIGHTINGS}")
    _check(0 <= loss.dpace_alpha <= 1, f"loss.dpace_alpha={loss.dpace_alpha} must be in [0, 1]")


def _check_optimizer(o: OptimizerConfig) -> None:
    _check(o.kind in OPTIMIZERS, f"optimizer.kind={o.kind!r} is not one of {OPTIMIZERS}")
    _check(o.lr > 0 and o.muon_lr > 0, f"optimizer.lr={o.lr} and optimizer.muon_lr={o.muon_lr} must be > 0")
    _check(0 <= o.muon_momentum < 1, f"optimizer.muon_momentum={o.muon_momentum} must be in [0, 1)")
    _check(
        o.kind != "muon" or o.grad_clip == 0,
        f"optimizer.grad_clip={o.grad_clip} with optimizer.kind=muon: ZeRO-1/2/3 clip DeepSpeed's Muon update after "
        f"orthogonalisation (its norm grows with the matrices' sizes, so the clip would shrink every step's update) "
        f"while ZeRO-0 clips the raw gradient; Muon's update is bounded by construction: set optimizer.grad_clip=0",
    )
    _check(all(0 <= b < 1 for b in o.betas), f"optimizer.betas={list(o.betas)}: each must be in [0, 1)")
    _check(
        o.eps > 0 and o.weight_decay >= 0 and o.grad_clip >= 0,
        "optimizer.eps must be > 0, optimizer.weight_decay and optimizer.grad_clip >= 0",
    )


def _check_schedule_and_outputs(cfg: TrainConfig) -> None:
    s = cfg.schedule
    _check(s.kind in SCHEDULES, f"schedule.kind={s.kind!r} is not one of {SCHEDULES}")
    _check(0 <= s.warmup_ratio < 1, f"schedule.warmup_ratio={s.warmup_ratio} must be in [0, 1)")
    _check(0 <= s.min_lr_ratio <= 1, f"schedule.min_lr_ratio={s.min_lr_ratio} must be in [0, 1]")
    _check(s.steps > 0 or s.epochs > 0, "set schedule.steps > 0 or schedule.epochs > 0")
    _check(s.epochs >= 0, f"schedule.epochs={s.epochs} must be >= 0")
    _check(s.steps >= 0, f"schedule.steps={s.steps} must be >= 0")
    _check(s.grad_accum >= 1, f"schedule.grad_accum={s.grad_accum} must be >= 1")
    _check(cfg.logging.every >= 1, f"logging.every={cfg.logging.every} must be >= 1")
    _check(cfg.checkpoint.every >= 0, f"checkpoint.every={cfg.checkpoint.every} must be >= 0")
    _check(cfg.checkpoint.keep_last >= 1, f"checkpoint.keep_last={cfg.checkpoint.keep_last} must be >= 1")
    _check(
        cfg.validation.every >= 0 and cfg.validation.max_batches >= 0,
        "validation.every and validation.max_batches must be >= 0",
    )
    _check(
        cfg.validation.every == 0 or cfg.data.val_fraction > 0,
        f"validation.every={cfg.validation.every} needs a held-out split: set data.val_fraction > 0",
    )
    _check_real_acceptance(cfg.validation)
    _check(cfg.precision in PRECISIONS, f"precision={cfg.precision!r} is not one of {PRECISIONS}")
    _check(cfg.export_dtype in EXPORT_DTYPES, f"export_dtype={cfg.export_dtype!r} is not one of {EXPORT_DTYPES}")


def _check_real_acceptance(v: ValidationConfig) -> None:
    v.thinking = {"true": "on", "false": "off"}.get(v.thinking.lower(), v.thinking)  # YAML reads `on` as true
    _check(v.decode_every == 0 or bool(v.prompts),
           f"validation.decode_every={v.decode_every} needs held-out prompts: set validation.prompts=FILE (the "
           f"formats `dflash-fast eval --data` reads)")
    _check(v.decode_every >= 0, f"validation.decode_every={v.decode_every} must be >= 0 (0: only at the end)")
    _check(v.num_prompts >= 1 and v.max_new_tokens >= 1,
           f"validation.num_prompts={v.num_prompts} and validation.max_new_tokens={v.max_new_tokens} must be >= 1")
    _check(v.temperature >= 0, f"validation.temperature={v.temperature} must be >= 0 (0: greedy only)")
    _check(v.thinking in ("", "on", "off"), f"validation.thinking={v.thinking!r} is not on, off or empty")
    _check(v.max_gap > 0, f"validation.max_gap={v.max_gap} must be > 0 (0.5: warn past a 50% gap)")
