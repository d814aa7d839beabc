"""The drafter a run trains, checked against its data before step 1.

    build_run_drafter   a fresh drafter on the target's frozen tensors (seeded by `seed`), or the drafter of an
                        export (model.init_from); either must match the store: layer ids, the target's sizes and
                        fingerprint, and what the loss kind reads (StoreMismatch names both values)
    planned_drafter_config  the architecture build_run_drafter would build, from config files (train.py --plan)
    resolve_loss_kind   loss.kind=auto -> kl where the store has `last`, else kl_topk
    export_format       the layout the run's final export takes, refused before step 1 if no engine would serve it
"""
from typing import Callable, Dict, Optional

import torch

from dflash_fast.drafter.config import DrafterConfig
from dflash_fast.drafter.losses import needs_last
from dflash_fast.drafter.model import DFlashDrafter, build_drafter
from dflash_fast.serve.engines import config_from_export, servable_format
from dflash_fast.serve.export import load_exported, read_export_config
from dflash_fast.serve.layouts import ExportError
from dflash_fast.target.load import check_target, config_sha256
from dflash_fast.train.config import DRAFTER_OPTIONS, ConfigError, ModelConfig, TrainConfig


class StoreMismatch(ConfigError):
    """The store was extracted from a different target or with different layer ids than the drafter uses."""


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


def build_run_drafter(cfg: TrainConfig, store_path: str, manifest: Dict, target: str, loss_kind: str,
                      dtype: torch.dtype, log: Callable[[str], None]) -> DFlashDrafter:
    """The drafter to train, its frozen embedding and lm_head ([V, H] each) in the compute dtype `dtype`, never
    as an fp32 copy: from model.init_from, else fresh from the target (initialised from the seed `cfg.seed`)."""
    m = cfg.model
    torch.manual_seed(cfg.seed)
    if m.init_from:
        return init_from_export(m, m.init_from, store_path, manifest, target, loss_kind, dtype, log)
    try:
        check_target(target)
        drafter = build_drafter(
            target,
            m.layer_ids or manifest["layer_ids"],
            m.mask_token_id,
            norm_kind=manifest["final_norm"]["kind"],
            frozen_dtype=dtype,
            **m.drafter_options(),
        )
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(
            f"cannot build the drafter from target {target!r} (model.target, default: the store's "
            f"target; model.mask_token_id sets the mask token): {e}"
        ) from None
    check_store_matches(store_path, manifest, drafter.config, target, loss_kind)
    return drafter


def planned_drafter_config(cfg: TrainConfig, manifest: Dict, target: str) -> DrafterConfig:
    """The architecture build_run_drafter would build, from the config files alone (no weight is read): what
    `train.py --plan` sizes. The mask token id changes no size: the last embedding row stands in for it."""
    from transformers import AutoConfig

    m = cfg.model
    try:
        target_config = AutoConfig.from_pretrained(check_target(target))
        if m.init_from:
            return config_from_export(read_export_config(m.init_from), target_config)
        text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        mask = text.vocab_size - 1 if m.mask_token_id is None else m.mask_token_id
        return DrafterConfig.from_target(target_config, m.layer_ids or manifest["layer_ids"], mask,
                                         **m.drafter_options())
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"cannot size the drafter of target {target!r} (model.target, model.init_from): {e}") \
            from None


def init_from_export(m: ModelConfig, path: str, store_path: str, manifest: Dict, target: str, loss_kind: str,
                     dtype: torch.dtype, log: Callable[[str], None]) -> DFlashDrafter:
    """The drafter of the export at `path` (model.init_from) with the target's frozen tensors. Refused, before
    any tensor is read, when it does not match the store or a model.* key set to other than its default."""
    from transformers import AutoConfig

    try:
        d = config_from_export(read_export_config(path), AutoConfig.from_pretrained(check_target(target)))
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"model.init_from={path}: {e}") from None
    try:
        check_store_matches(store_path, manifest, d, target, loss_kind)
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
        drafter = load_exported(path, target, manifest["final_norm"]["kind"], frozen_dtype=dtype)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"model.init_from={path}: {e}") from None
    log(f"drafter initialised from the export {path}")
    return drafter


def export_format(cfg: TrainConfig, drafter: DrafterConfig) -> Optional[str]:
    """The format the run's final export takes (None with export=false); a ConfigError before step 1 when no
    serving engine would serve the drafter as it trains."""
    if not cfg.export:
        return None
    try:
        return servable_format(drafter)
    except ExportError as e:
        raise ConfigError(f"{e}\nthis run ends with an export that no serving engine would serve as it "
                          f"trained: change the drafter, or set export=false") from None
