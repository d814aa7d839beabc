"""Export a trained drafter for serving, prove that it serves as it trained, and load exported drafters back.

The files written are one of `dflash_fast.serve.layouts`' two layouts (OUT/config.json, OUT/model.safetensors of the
trainable weights); how each serving engine reads them back is `dflash_fast.serve.engines`'.

The gate. An export is written into a temporary directory beside OUT and read back the way every engine that
loads its format reads it (`engines.served_architectures`). Every engine's architecture is compared field by field
with the trained drafter's, a drafter rebuilt from the written files is compared with the trained one on a random
batch (fp32 logits, eager ops, `GATE_TOLERANCE`; a DFlash2 drafter's candidate selector scores too), and only a
passing export is renamed to OUT. `load_exported`
reads an export through the same engine rules and refuses one the engines would read differently.
"""

import glob
import json
import os
import shutil
import tempfile
from typing import Callable, Dict, Optional

import torch

from dflash_fast.drafter import ops
from dflash_fast.drafter.config import DrafterConfig
from dflash_fast.drafter.model import DFlashDrafter
from dflash_fast.drafter.weights import check_tensors, load_frozen_tensors, read_tensors, stderr_line
from dflash_fast.errors import Is, MapOf, Obj, check_schema, read_mapping
from dflash_fast.serve.architecture import architecture
from dflash_fast.serve.engines import (
    check_made_for,
    check_servable,
    config_from_export,
    mismatches,
    served_architectures,
)
from dflash_fast.serve.layouts import CONFIG_SCHEMAS, ExportError, export_format, format_config
from dflash_fast.serve.model_card import CARD, model_card, read_provenance, trained_thinking
from dflash_fast.store.format import write_json_atomic

WEIGHTS = "model.safetensors"


WEIGHTS_INDEX = "model.safetensors.index.json"


# Tensors other tools save next to the drafter that come from the target here: speculators' DFlashDraftModel
# saves embed_tokens / lm_head (src/speculators/models/dflash/core.py, _keys_to_ignore_on_load_missing).
FROZEN_TENSORS = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight")


# An export's safetensors index: errors.WEIGHTS_INDEX_SCHEMA, every shard a file inside the export directory.
EXPORT_INDEX_SCHEMA = Obj({"weight_map": MapOf(Is(
    "a shard's file name (shards are file names inside the export directory)",
    lambda v: isinstance(v, str) and os.path.basename(v) == v and v not in ("", ".", ".."),
))})


# The gate's logits check: a drafter rebuilt from the export against the trained one with its weights rounded to
# the export dtype, both in fp32 on the eager ops.
GATE_TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def trainable_state_dict(drafter: DFlashDrafter) -> Dict[str, torch.Tensor]:
    """Module names already follow both layouts' (`fc.weight`, `layers.{i}.self_attn.q_proj.weight`, ...)."""
    return {name: p.detach().contiguous() for name, p in drafter.named_parameters()}


def read_weights(
    export_dir: str, cfg: DrafterConfig, warn: Callable[[str], None] = stderr_line
) -> Dict[str, torch.Tensor]:
    """The drafter tensors of model.safetensors, or of the shards model.safetensors.index.json lists (never
    unpickled), checked against `cfg` by check_tensors: headers first (nothing loaded when the config implies more
    parameters than the files hold), then the values. FROZEN_TENSORS stored beside them are not loaded."""
    from safetensors import SafetensorError, safe_open

    index = os.path.join(export_dir, WEIGHTS_INDEX)
    if os.path.exists(index):
        weight_map = _read_json(index, EXPORT_INDEX_SCHEMA)["weight_map"]
        if not weight_map:
            raise ExportError(f"{index} has no weight_map object ({{tensor name: shard file}})")
        files = [os.path.join(export_dir, name) for name in sorted(set(weight_map.values()))]
        stored = set()
        for path in files:
            try:
                with safe_open(path, "pt") as f:
                    stored |= set(f.keys())
            except (SafetensorError, OSError) as e:
                raise ExportError(f"{path} is not a readable safetensors file: {e}") from None
        misplaced = sorted(stored ^ set(weight_map))
        if misplaced:
            raise ExportError(f"{index} and its shards disagree: {misplaced[:6]} are in one but not the other")
        where = f"{index} (against its config.json)"
    elif os.path.exists(os.path.join(export_dir, WEIGHTS)):
        files = [os.path.join(export_dir, WEIGHTS)]
        where = f"{files[0]} (against its config.json)"
    else:
        raise ExportError(f"{export_dir} has neither {WEIGHTS} nor {WEIGHTS_INDEX}")
    return read_tensors(files, cfg, ExportError, unused=FROZEN_TENSORS, where=where, warn=warn)


def _read_json(path: str, schema: Optional[Obj] = None) -> Dict:
    return read_mapping(path, json.load, json.JSONDecodeError, ExportError, "JSON", "a JSON object", schema=schema)


def read_export_config(export_dir: str) -> Dict:
    """config.json of an export directory, refused when it is neither layout or a key its layout's readers take
    holds the wrong kind of JSON value (the error names the key's path)."""
    path = os.path.join(export_dir, "config.json")
    config = _read_json(path)
    fmt = export_format(config)
    if fmt is None:
        served_architectures(config)  # raises, naming both layouts
    return check_schema(config, CONFIG_SCHEMAS[fmt], path, ExportError)


def exported_thinking(export_dir: str) -> Dict[str, int]:
    """How the drafter's training conversations were rendered, as its export records them (config.json
    dflash_fast.thinking: counts of conversations with the target thinking "on" / "off"); {} when not recorded
    (an export written before dflash-fast recorded it, a published one, a run whose data did not say)."""
    return (read_export_config(export_dir).get("dflash_fast") or {}).get("thinking") or {}


def load_exported(
    export_dir: str,
    target_path: Optional[str] = None,
    norm_kind: Optional[str] = None,
    frozen_dtype: torch.dtype = torch.float32,
) -> DFlashDrafter:
    """A drafter from an export of either layout (ours or a published one), as its engines serve it. With
    target_path the frozen tensors are the target's (`norm_kind`, `frozen_dtype`: see load_frozen_tensors)."""
    config = read_export_config(export_dir)
    target_config = None
    if target_path is not None:
        from transformers import AutoConfig

        target_config = AutoConfig.from_pretrained(target_path)
    cfg = config_from_export(config, target_config)
    if target_config is not None:
        check_made_for(cfg, target_config, f"the drafter in {export_dir}")
    weights = read_weights(export_dir, cfg)
    drafter = DFlashDrafter(cfg, frozen_dtype)
    drafter.load_trainable(weights)
    if target_path is not None:
        drafter.set_frozen(**load_frozen_tensors(target_path, frozen_dtype, norm_kind=norm_kind))
    return drafter


def gate_batch(cfg: DrafterConfig, seed: int = 0) -> Dict[str, torch.Tensor]:
    """One random row that reaches past a sliding window when the window is short (long windows are covered by
    the field comparison): hidden [1, T, K, H_t], four anchors, one document."""
    g = torch.Generator().manual_seed(seed)
    window = min(cfg.sliding_window or 0, 128)
    t = max(3 * cfg.block_size, window + 2 * cfg.block_size)
    anchors = torch.linspace(1, t - 2, 4).long()[None]
    return {
        "hidden": torch.randn(1, t, cfg.num_tapped, cfg.target_hidden_size, generator=g),
        "input_ids": torch.randint(0, cfg.vocab_size, (1, t), generator=g),
        "position_ids": torch.arange(t)[None],
        "document_ids": torch.zeros(1, t, dtype=torch.long),
        "loss_mask": torch.ones(1, t, dtype=torch.bool),
        "anchors": anchors,
        "anchor_valid": torch.ones_like(anchors, dtype=torch.bool),
    }


def gate_logits(drafter: DFlashDrafter, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """fp32 logits of every block slot [1, A*B, V] on the eager ops (spec.md's reference semantics); a DSpark
    drafter's with the Markov bias, and its confidence logit as one more column [1, A*B, V + 1]."""
    with torch.no_grad(), ops.backend("eager"):
        logits, confidence = drafter.block_logits(batch)
    return logits if confidence is None else torch.cat([logits, confidence[..., None]], dim=-1)


def _differing(reference: Dict[str, torch.Tensor], served: Dict[str, torch.Tensor]) -> str:
    """The tensors read back from an export that differ from those written (the cause of a gate failure, named)."""
    names = [name for name, t in reference.items() if name in served and not torch.equal(served[name].to(t.dtype), t)]
    return f"; tensors read back other than written: {names}" if names else ""


def gate(export_dir: str, trained: DrafterConfig, tensors: Dict[str, torch.Tensor]) -> None:
    """Read `export_dir` back as its engines do and compare with the trained drafter (`tensors`: its weights as
    written); raises ExportError naming the first field, tensor or logit that differs."""
    config = read_export_config(export_dir)
    problems = mismatches(architecture(trained), served_architectures(config))
    if problems:
        raise ExportError("the written export would be served differently from the trained drafter:\n  - "
                          + "\n  - ".join(problems))
    g = torch.Generator().manual_seed(1)
    frozen = dict(  # random but shared: both drafters see the same embedding and lm_head, held once
        embed_tokens=torch.randn(trained.vocab_size, trained.hidden_size, generator=g),
        lm_head=torch.randn(trained.vocab_size, trained.hidden_size, generator=g),
        target_norm=1 + 0.1 * torch.randn(trained.hidden_size, generator=g),
    )
    check_tensors(trained, tensors, "the weights to export (in the export dtype)", ExportError)
    reference = DFlashDrafter(trained, frozen_dtype=torch.bfloat16)
    reference.load_trainable(tensors)
    served_config = config_from_export(config)
    served_weights = read_weights(export_dir, served_config, warn=lambda _: None)  # warned of as `tensors`
    served = DFlashDrafter(served_config, frozen_dtype=torch.bfloat16)
    served.load_trainable(served_weights)
    for drafter in (reference, served):
        for name, value in frozen.items():
            setattr(drafter, name, value)
    batch = gate_batch(trained)
    want, got = gate_logits(reference, batch), gate_logits(served, batch)
    compared = [("logits", want, got)]
    with torch.no_grad(), ops.backend("eager"):  # what a family adds to its logits (DFlash2: the selector's scores)
        theirs = served.gate_outputs(batch, want)
        compared += [(what, mine, theirs[what]) for what, mine in reference.gate_outputs(batch, want).items()]
    for what, want, got in compared:
        if not torch.isfinite(want).all() or not torch.allclose(got, want, **GATE_TOLERANCE):
            worst = (got - want).abs().nan_to_num(float("inf")).max().item()
            raise ExportError(
                f"a drafter rebuilt from {export_dir} gives other {what} than the trained one on a random batch "
                f"(max |difference| {worst:.3g}, tolerance {GATE_TOLERANCE}; non-finite trained {what}: "
                f"{not torch.isfinite(want).all()}){_differing(tensors, served_weights)}"
            )


def _is_replaceable(path: str) -> bool:
    """An earlier export (or an empty directory) may be replaced; anything else is refused, never deleted."""
    if not os.path.isdir(path):
        return False
    names = set(os.listdir(path))
    return not names or ("config.json" in names and names <= {"config.json", WEIGHTS, WEIGHTS_INDEX, CARD})


def export_drafter(
    drafter: DFlashDrafter,
    out_dir: str,
    verifier: str,
    dtype: Optional[torch.dtype] = torch.bfloat16,
    state_dict: Optional[Dict[str, torch.Tensor]] = None,
    fmt: str = "speculators",
    warn: Callable[[str], None] = stderr_line,
    card: Optional[str] = None,
    thinking: Optional[Dict[str, int]] = None,
) -> str:
    """Write OUT/config.json and OUT/model.safetensors in `fmt`, gated: written into a temporary directory beside
    OUT, read back as the serving engines read it, and renamed to OUT only when it passes; nothing is left behind
    on failure. `state_dict` overrides the module's own weights (e.g. gathered from ZeRO-3). An engine that serves
    another SERVING_RULES rule than the drafter trained with is warned of (one line each). `card`: the text of
    OUT/README.md (model_card), written with the rest. `thinking`: the training conversations' counts by thinking
    setting (model_card.trained_thinking), recorded as config.json dflash_fast.thinking. Returns out_dir."""
    from safetensors.torch import save_file

    cfg = drafter.config
    check_servable(cfg, fmt)
    rules = mismatches(architecture(cfg), served_architectures(format_config(cfg, fmt, verifier="")), True)
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and not _is_replaceable(out_dir):
        raise ExportError(f"{out_dir} exists and is not an export: choose another output directory")
    tensors = state_dict if state_dict is not None else trainable_state_dict(drafter)
    tensors = {k: (v.to(dtype) if dtype is not None else v).cpu().contiguous() for k, v in tensors.items()}
    parent, name = os.path.split(out_dir)
    os.makedirs(parent, exist_ok=True)
    for stale in glob.glob(os.path.join(parent, glob.escape(name) + ".tmp-*")):  # left by a killed export
        shutil.rmtree(stale, ignore_errors=True)
    tmp = tempfile.mkdtemp(prefix=name + ".tmp-", dir=parent)
    try:
        save_file(tensors, os.path.join(tmp, WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(tmp, WEIGHTS), "rb") as f:
            os.fsync(f.fileno())
        config = format_config(cfg, fmt, verifier)
        if thinking:  # what `dflash-fast eval` compares its prompts' setting with
            config["dflash_fast"]["thinking"] = thinking
        write_json_atomic(os.path.join(tmp, "config.json"), config)
        if card is not None:
            with open(os.path.join(tmp, CARD), "w") as f:
                f.write(card)
        gate(tmp, cfg, tensors)
        old = None
        if os.path.exists(out_dir):
            old = tempfile.mkdtemp(prefix=name + ".old-", dir=parent)
            os.replace(out_dir, os.path.join(old, "export"))
        os.replace(tmp, out_dir)
        if old is not None:
            shutil.rmtree(old)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for line in rules:
        warn(f"warning: {out_dir} serves at a lower acceptance than it trained for: model.{line}")
    return out_dir


def export_run(drafter: DFlashDrafter, out_dir: str, verifier: str, dtype: Optional[torch.dtype], fmt: str,
               run_dir: str, client: Dict, report: Optional[Dict] = None,
               state_dict: Optional[Dict[str, torch.Tensor]] = None) -> str:
    """A training run's drafter exported with its model card (`dflash-fast export` and the trainer's own export):
    the card from the checkpoint's client state (step, run config), the run's OUT/provenance.json and an eval
    report, the provenance's thinking counts recorded in config.json; written and gated by export_drafter.
    Returns out_dir."""
    provenance = read_provenance(run_dir)
    card = model_card(drafter.config, verifier, fmt, os.path.abspath(out_dir), client, provenance, report)
    return export_drafter(drafter, out_dir, verifier, dtype, state_dict=state_dict, fmt=fmt, card=card,
                          thinking=trained_thinking(provenance))
