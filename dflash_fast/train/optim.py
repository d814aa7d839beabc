"""The optimizer and its learning-rate schedule, as DeepSpeed runs them.

    param_groups        the trainable parameters: matrices (weight decay) and the norm weights (none)
    deepspeed_config    the DeepSpeed JSON (ZeRO, offload, communication) completed from the YAML, which owns every
                        training hyperparameter; optimizer.kind=muon writes DeepSpeed's own Muon section
    build_engine        deepspeed.initialize with AdamW (torch's, or DeepSpeedCPUAdam under optimizer offload) or
                        Muon, and the schedule: linear warmup, then cosine (or constant) per optimizer step
    resume_schedule     a resumed run's schedule at the resumed step: this run's config governs every step after it
    check_muon          refuses a Muon that would not orthogonalise every trainable matrix (before step 1, and
    check_muon_stepped  after the first ZeRO-0 step)
"""
import json
import math
import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from dflash_fast.drafter.model import DFlashDrafter
from dflash_fast.errors import read_mapping
from dflash_fast.train.config import ConfigError, ScheduleConfig, TrainConfig

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


# ---------------------------------------------------------------- the DeepSpeed JSON


def deepspeed_config(path: str, cfg: TrainConfig, precision: str) -> Dict:
    """The DeepSpeed JSON at `path` (ZeRO, offload, communication) completed from the YAML."""
    if not os.path.exists(path):
        raise ConfigError(f"deepspeed={path}: file not found (ships: configs/ds_zero1.json, ds_zero2.json, "
                          f"ds_zero3.json, ds_zero3_offload.json)")
    ds = read_mapping(path, json.load, json.JSONDecodeError, ConfigError, "JSON", "a DeepSpeed config object")
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


# ---------------------------------------------------------------- the schedule


def total_steps(schedule: ScheduleConfig, micro_batches_per_epoch: int) -> int:
    """Optimizer steps of the run: schedule.steps, else schedule.epochs over this rank's micro-batches."""
    return schedule.steps or math.ceil(schedule.epochs * micro_batches_per_epoch / schedule.grad_accum)


def lr_multiplier(step: int, total: int, warmup: int, kind: str, min_ratio: float) -> float:
    """Learning-rate factor of update `step` (0-based): linear warmup reaching 1 at update warmup-1,
    then cosine from 1 down to min_ratio at the end (or constant 1)."""
    if step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def resume_schedule(engine, step: int) -> None:
    """After a resume at `step` (optimizer steps done): every parameter group's learning rate is this run's
    schedule at update `step`, base_lr * lr_multiplier(step, ...), the first resumed update included.

    The checkpoint's optimizer state carries the learning rate its own schedule gave that update; with a changed
    schedule.steps, warmup or optimizer.lr the first resumed update would run at it. The scheduler's state is not
    read from the checkpoint (checkpoint.load_training_state): the schedule is a function of the config and the
    step alone."""
    scheduler = engine.lr_scheduler
    scheduler.last_epoch = step
    lrs = [base * multiplier(step) for base, multiplier in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


# ---------------------------------------------------------------- the optimizer


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


def build_engine(drafter: DFlashDrafter, cfg: TrainConfig, ds: Dict, steps: int) -> Tuple[object, object, str]:
    """deepspeed.initialize with the optimizer and the schedule over `steps` optimizer steps -> (engine, its
    optimizer, a line naming the optimizer for the log). Muon is checked here (check_muon)."""
    import deepspeed

    s = cfg.schedule
    warmup = round(s.warmup_ratio * steps)
    optimizer = build_optimizer(drafter, cfg, offloads_optimizer(ds))

    def scheduler(basic_optimizer):  # DeepSpeed calls it with the optimizer it built (Muon) or was given
        return torch.optim.lr_scheduler.LambdaLR(
            basic_optimizer, lambda k: lr_multiplier(k, steps, warmup, s.kind, s.min_lr_ratio)
        )

    engine, engine_optimizer, _, _ = deepspeed.initialize(
        model=drafter,
        optimizer=optimizer,
        model_parameters=param_groups(drafter, cfg.optimizer.weight_decay) if optimizer is None else None,
        lr_scheduler=scheduler,
        config=ds,
    )
    line = "AdamW"
    if cfg.optimizer.kind == "muon":
        line = f"Muon on {len(check_muon(engine))} matrices (fc and the layers' projections), AdamW on the norms"
    return engine, engine_optimizer, line


# ---------------------------------------------------------------- Muon's checks


def _layer_shape(p: torch.nn.Parameter) -> Tuple[int, ...]:
    """The shape the parameter has as a layer (under ZeRO-3 `p.shape` is that of a flat partition)."""
    return tuple(getattr(p, "ds_shape", p.shape))


# DeepSpeed's Muon leaves to the auxiliary AdamW every parameter whose name holds one of these (deepspeed/__init__.py,
# the use_muon tagging): LiLiCorr's slot and rank embeddings, any embedding or lm_head.
MUON_EXCLUDED_NAMES = ("embed", "lm_head")


def takes_muon(name: str, shape: Sequence[int]) -> bool:
    """Whether DeepSpeed's Muon orthogonalises this parameter: a matrix (two or more dimensions as a layer) whose
    name is not an embedding's or lm_head's."""
    return len(shape) >= 2 and not any(word in name.lower() for word in MUON_EXCLUDED_NAMES)


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
        is_matrix = takes_muon(name, _layer_shape(p))
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
