"""What the serving engines make of an export, and the verdicts: `served_architectures` reads a config.json as each
engine of its layout does (dflash_fast.serve.views) into the terms of `architecture.ARCHITECTURE`; `check_servable`
refuses a drafter its format's engines would serve differently from how it trained (`mismatches`, with a hint for
each known cause), `config_from_export` rebuilds the DrafterConfig of an export the engines agree on,
`check_made_for` refuses one made for another target.
"""
from typing import Dict, List, Tuple

from dflash_fast.drafter.config import DrafterConfig, value_problems
from dflash_fast.drafter.masks import WINDOW_RULES
from dflash_fast.errors import check_schema, is_int
from dflash_fast.serve.architecture import ARCHITECTURE, architecture
from dflash_fast.serve.families import LAYOUTS, family_of, hints
from dflash_fast.serve.layouts import (
    ARCHITECTURES,
    CONFIG_SCHEMAS,
    FORMATS,
    ZLAB_ARCHITECTURES,
    ExportError,
    export_format,
    format_config,
)
from dflash_fast.serve.views import VIEWS, _check_zlab_neutral, zlab_tap_problems
from dflash_fast.store.layer_ids import check_layer_ids

# The engines that read each layout; a family's serving home may name fewer (FamilyLayout.engines: LiLiCorr's vLLM).
ENGINES = {"speculators": ("speculators", "vllm"), "zlab": ("sglang", "vllm")}
# Why an engine reads a field differently, and the fix, for the mismatches that have a known cause.
# Fields where an engine that serves another rule than the drafter trained with still runs it, at a lower acceptance:
# export warns of them (naming the field) instead of refusing, and reads them back from our own metadata.
SERVING_RULES = ("window_from",)
HINTS = {
    "window_from": "vLLM, SGLang and z-lab end each query's sliding window at its own position, speculators 0.9.0 "
    "trains spec.md §4's window at the anchor: the drafter runs, but accepts fewer tokens than it would with the rule "
    "it trained with; train with model.window_from=query to serve in vLLM or SGLang (docs/vllm.md)",
    "layer_causal": "speculators serves full-attention layers bidirectional in the block and all sliding layers "
    "one rule, vLLM gives every layer of a speculators export one rule (sliding_window_non_causal), SGLang and vLLM "
    "serve a zlab export's full layers bidirectional and sliding layers causal (set model.causal_in_block to match, "
    "or export the other format)",
    "rope_parameters": "SGLang's DFlash rotates all head_dim channels (get_rope(rotary_dim=head_dim)): export "
    "a drafter with partial_rotary_factor 1 to the zlab format, or use the speculators format (vLLM applies it)",
    "target_hidden_size": "speculators and SGLang size fc from the drafter's hidden_size: the drafter's hidden size "
    "must equal the target's",
    **hints(),  # the families' fields (their serving homes)
}


def serving_engines(fmt: str, family: str) -> Tuple[str, ...]:
    """The engines that read a `family` drafter's export in `fmt` (ENGINES, or the fewer its serving home names)."""
    return LAYOUTS[family].engines or ENGINES[fmt]


def served_architectures(config: Dict) -> Dict[str, Dict]:
    """{engine: architecture as that engine builds it} for a config.json of either layout, judged first by its
    layout's declared schema (layouts.CONFIG_SCHEMAS: the JSON kind of every key the views read)."""
    fmt = export_format(config)
    if fmt is None:
        raise ExportError(
            f"config.json is not a DFlash drafter: it has neither speculators_model_type one of "
            f"{sorted(ARCHITECTURES)} (speculators layout) nor architectures one of "
            f"{sorted(ZLAB_ARCHITECTURES.values())} with a dflash_config (z-lab layout)"
        )
    check_schema(config, CONFIG_SCHEMAS[fmt], "config.json", ExportError)  # every view trusts the JSON kinds
    if fmt == "zlab":
        _check_zlab_neutral(config)
    served = {}
    for engine in serving_engines(fmt, family_of(config, fmt).name):
        try:
            served[engine] = VIEWS[fmt, engine](config)
        except (TypeError, AttributeError) as e:  # a hand-edited key of the wrong JSON type (a list for an object)
            raise ExportError(f"config.json cannot be read as {engine} reads it, a key holds the wrong kind of "
                              f"value: {e}") from None
    return served


def _check_values(arch: Dict) -> None:
    """Refuse an architecture read from a file whose fields hold the wrong kind of value or a meaningless one (a
    hand-edited `"block_size": "16"` or `"rope_theta": -1` would otherwise build a drafter that fails far from the
    cause): the drafter's own value rules (value_problems), each sliding window included."""
    windows = dict.fromkeys(w for w in arch["layer_windows"] if w is not None)
    read = {k: v for k, v in arch.items() if k not in SERVING_RULES}  # the engines' rules, not read from the file
    problems = value_problems(read) + [p for w in windows for p in value_problems({"sliding_window": w})]
    if problems:
        raise ExportError("config.json:\n  - " + "\n  - ".join(problems))


def mismatches(expected: Dict, served: Dict[str, Dict], serving_rules: bool = False) -> List[str]:
    """One line per field where an engine's architecture differs from `expected`, with the known cause: the fields
    an engine must build as trained, or with serving_rules the SERVING_RULES."""
    lines = []
    for engine, arch in served.items():
        for field in ARCHITECTURE:
            if (field in SERVING_RULES) != serving_rules:
                continue
            if arch[field] != expected[field]:
                hint = f" ({HINTS[field]})" if field in HINTS else ""
                lines.append(f"{field}: trained {expected[field]!r}, {engine} serves {arch[field]!r}{hint}")
    return lines


def check_servable(cfg: DrafterConfig, fmt: str) -> None:
    """Refuse, before anything is written, a drafter that the engines of `fmt` would serve differently: first what
    its family's serving home refuses (FamilyLayout.refusals), then every field an engine reads otherwise."""
    family = LAYOUTS[cfg.family]
    problems = family.refusals(cfg, fmt)
    if problems:
        raise ExportError(f"the {fmt} format cannot serve this {family.short} drafter as it trained:\n  - "
                          + "\n  - ".join(problems))
    problems = mismatches(architecture(cfg), served_architectures(format_config(cfg, fmt, verifier="")))
    if fmt == "zlab":
        problems += zlab_tap_problems(cfg.layer_ids, cfg.target_num_layers)
    if problems:
        raise ExportError(f"the {fmt} format cannot serve this drafter as it trained:\n  - " + "\n  - ".join(problems))


def servable_format(cfg: DrafterConfig) -> str:
    """The first of FORMATS whose engines serve `cfg` as it trained (speculators, then zlab: z-lab's pattern of
    causal sliding and bidirectional full layers only serves from the zlab layout); refused naming each format's
    problems when neither does."""
    problems = []
    for fmt in FORMATS:
        try:
            check_servable(cfg, fmt)
            return fmt
        except ExportError as e:
            problems.append(str(e))
    raise ExportError("\n".join(problems))


def config_from_architecture(arch: Dict, target_num_layers: int, target_model_type: str = "",
                             window_from: str = "anchor") -> DrafterConfig:
    windows = {w for w in arch["layer_windows"] if w is not None}
    if len(windows) > 1:
        raise ExportError(f"the layers use different sliding windows {sorted(windows)}; dflash-fast drafters use one")
    kept = {k: arch[k] for k in ARCHITECTURE if k not in ("layer_windows", "layer_causal", *SERVING_RULES)}
    return DrafterConfig(
        **kept,
        layer_types=["sliding" if w is not None else "full" for w in arch["layer_windows"]],
        sliding_window=windows.pop() if windows else None,
        window_from=window_from,
        causal_in_block=arch["layer_causal"],
        target_num_layers=target_num_layers,
        target_model_type=target_model_type,
    )


def config_from_export(config: Dict, target_config=None) -> DrafterConfig:
    """The DrafterConfig of an export of either layout (ours or another tool's), as its engines serve it; refused
    when they would serve it differently. The window rule is the one it trained with (our metadata's
    window_from; spec.md §4's "anchor" for an export without it), whichever rule an engine serves."""
    served = served_architectures(config)
    engines = list(served)
    first = served[engines[0]]
    for arch in served.values():  # before comparing: NaN differs from itself
        _check_values(arch)
    problems = [line for line in mismatches(first, {e: served[e] for e in engines[1:]})]
    if problems:
        raise ExportError(
            f"{engines[0]} and {' / '.join(engines[1:])} would serve this export differently (the values before "
            f"'serves' are {engines[0]}'s):\n  - " + "\n  - ".join(problems)
        )
    ours = config.get("dflash_fast") or {}
    if not isinstance(ours, dict):
        raise ExportError(f"config.json: dflash_fast={ours!r} is not an object")
    target_layers = ours.get("target_num_layers") or config.get("num_target_layers")
    if target_layers is not None and (not is_int(target_layers) or target_layers < 1):
        raise ExportError(f"config.json: the target's layer count {target_layers!r} is not an integer >= 1")
    model_type = ours.get("target_model_type", "")
    window_from = ours.get("window_from", "anchor")
    if value_problems({"window_from": window_from}):
        raise ExportError(f"config.json: dflash_fast.window_from={window_from!r} is not one of {WINDOW_RULES}")
    if target_config is not None:
        tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        target_layers, model_type = target_layers or tc.num_hidden_layers, model_type or tc.model_type
    ids = first["layer_ids"]
    target_layers = target_layers or 1 + max((i for i in ids if isinstance(i, int)), default=0)
    try:
        check_layer_ids(ids, target_layers)
    except ValueError as e:
        raise ExportError(f"the export's target layer ids {ids} (our convention): {e}") from None
    try:
        return config_from_architecture(first, target_layers, model_type, window_from)
    except (TypeError, ValueError) as e:
        raise ExportError(f"the export's drafter is not one dflash-fast can build: {e}") from None


def check_made_for(cfg: DrafterConfig, target_config, where: str) -> None:
    """Refuse a drafter made for another target than `target_config`'s, naming both values (before any tensor
    is read: a mismatch would otherwise surface deep in a matmul or as a wrong hidden state)."""
    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    problems = [
        f"{what}: the drafter was made for {theirs}, the target has {ours}"
        for what, theirs, ours in (
            ("vocabulary size", cfg.vocab_size, tc.vocab_size),
            ("hidden size", cfg.target_hidden_size, tc.hidden_size),
            ("decoder layers", cfg.target_num_layers, tc.num_hidden_layers),
        )
        if theirs != ours
    ]
    if problems:
        raise ExportError(f"{where} does not fit this target (give the target it was trained on):\n  - "
                          + "\n  - ".join(problems))
