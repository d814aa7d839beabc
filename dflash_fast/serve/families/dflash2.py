"""DFlash2 (spec.md §9) on the serving side: in either layout, read by speculators' DFlash2SpeculatorConfig, vLLM's
qwen3_dflash2.py (from the speculators layout's top level through its adapter, from the z-lab layout's
dflash_config), SGLang's and z-lab's DFlash2DraftModel (dflash_config). Its four fields keep the names speculators
gives them; LiLiCorr reads the two convolution fields too (lilicorr.py), and SGLang builds the convolutions of any
DFlash draft whose dflash_config sets them (`sglang_convolutions`)."""
from typing import Dict, List, Optional, Tuple

from dflash_fast.drafter.config import DrafterConfig
from dflash_fast.errors import INT, Nullable, is_int
from dflash_fast.serve.families.base import (
    VIEW_SGLANG,
    VIEW_SPECULATORS,
    VIEW_VLLM_SPECULATORS,
    VIEW_VLLM_ZLAB,
    ExportError,
    FamilyLayout,
)

# DFlash2's fields (spec.md §9) as speculators' DFlash2SpeculatorConfig names them (models/dflash2/config.py)
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# DFlash2's convolution fields, which vLLM's LiLiCorr reads from dflash_config (LiLiCorr.__init__: both or neither)
CONV_FIELDS = DFLASH2_FIELDS[:2]
# models/dflash2/config.py: DFlash2SpeculatorConfig's defaults, each ge=1
SPECULATORS_DFLASH2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16)
HINTS = {
    "conv_kernel_size": "speculators' DFlash2SpeculatorConfig, vLLM's and z-lab's DFlash2DraftModel build both "
    "DFlash2 additions: train model.conv_kernel_size >= 1 with model.selector_rank >= 1",
    "selector_rank": "speculators' DFlash2SpeculatorConfig, vLLM's, SGLang's and z-lab's DFlash2DraftModel build the "
    "candidate selector: train model.selector_rank >= 1 with model.conv_kernel_size >= 1",
}


def dflash2_fields(taps, group, rank, top_k) -> Dict:
    """DFlash2's fields of `ARCHITECTURE`; without a convolution its group size, without a selector its K, is moot
    and reads as the default 16."""
    return dict(conv_kernel_size=taps, conv_group_size=group if taps else 16, selector_rank=rank,
                selector_top_k=top_k if rank else 16)


DFLASH2_OFF = dflash2_fields(0, 16, 0, 16)


def dflash2_read(holder: Dict, where: str, defaults: Optional[Dict] = None) -> Dict:
    """DFlash2's four fields from `holder` (a config.json's top level or its dflash_config), each an integer >= 1 as
    the engine builds it (speculators: pydantic ge=1; vLLM, z-lab: int(dflash_config[key]) with no default; a
    convolution needs its group to divide the hidden size, checked by _check_values); `defaults` fills absent
    keys (speculators' DFlash2SpeculatorConfig: 2, 16, 256, 16), else an absent key is refused."""
    values = {}
    for key in DFLASH2_FIELDS:
        value = holder.get(key, (defaults or {}).get(key))
        if not is_int(value) or value < 1:
            raise ExportError(f"{where}: {key}={value!r}; its DFlash2 model builds that size, an integer >= 1 "
                              f"(speculators' DFlash2SpeculatorConfig names the four fields {list(DFLASH2_FIELDS)})")
        values[key] = value
    return dflash2_fields(*values.values())


def sglang_convolutions(config: Dict, where: str) -> Dict:
    """SGLang, models/dflash.py: every DFlash draft builds the convolutions when dflash_config.conv_kernel_size is
    set (DFlashDraftModel.__init__, grouped_conv), only DFlash2DraftModel the candidate selector (it raises without
    selector_rank)."""
    dflash = config["dflash_config"]
    if not dflash.get("conv_kernel_size"):
        return {}
    taps = dflash2_read({**dflash, "selector_rank": 1, "selector_top_k": 1}, where + ": dflash_config")
    return dict(taps, selector_rank=0, selector_top_k=16)


class DFlash2(FamilyLayout):
    name = "dflash2"
    short = "DFlash2"
    title = "DFlash2 (DFlash backbone with dynamic convolutions and a candidate selector)"
    speculators_architecture = "DFlash2DraftModel"
    zlab_architecture = "DFlash2DraftModel"
    vllm_v2 = True  # config/vllm.py: "DFlash candidate-head drafts" are the V2 speculator's only
    off = DFLASH2_OFF
    hints = HINTS
    # gguf-py tensor_mapping.py (DFLASH_ATTN_CONV_*, DFLASH_FFN_CONV_*, DFLASH_SELECTOR_*); conversion/qwen.py
    # DFlashModel.modify_tensors adds ".weight" to the codebooks; src/models/dflash.cpp loads them all only when
    # selector_hidden.weight is there
    gguf_tensors = {
        "layers.{i}.attention_conv.base_kernel": "blk.{i}.attn_conv_base",
        "layers.{i}.attention_conv.kernel_projection.weight": "blk.{i}.attn_conv_proj.weight",
        "layers.{i}.mlp_conv.base_kernel": "blk.{i}.ffn_conv_base",
        "layers.{i}.mlp_conv.kernel_projection.weight": "blk.{i}.ffn_conv_proj.weight",
        "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
        "candidate_selector.successor_codebook": "selector_successor.weight",
        "candidate_selector.hidden_projection.weight": "selector_hidden.weight",
    }
    schema = {fmt: {key: Nullable(INT) for key in DFLASH2_FIELDS} for fmt in ("speculators", "zlab", "dflash_config")}

    def fields(self, cfg: DrafterConfig) -> Dict:
        return dflash2_fields(*(getattr(cfg, key) for key in DFLASH2_FIELDS))

    def speculators_fields(self, cfg: DrafterConfig) -> Dict:
        return {key: getattr(cfg, key) for key in DFLASH2_FIELDS}

    def zlab_fields(self, cfg: DrafterConfig) -> Tuple[Dict, Dict]:
        """DFlash2's four fields in dflash_config (z-lab's dflash 0.1.0 model.py, SGLang's models/dflash.py and vLLM's
        qwen3_dflash2.py read them there; z-lab's Qwen3.8-27B-DFlash2)."""
        return {}, self.speculators_fields(cfg)

    def read(self, view: Tuple[str, str], config: Dict, hf, where: str) -> Dict:  # noqa: ARG002 (a hook)
        if view == VIEW_SPECULATORS:
            if config.get("sample_from_anchor", False):
                raise ExportError(f"{where}: a DFlash2 drafter with sample_from_anchor=true: speculators' DFlash2 and "
                                  f"vLLM's dflash2 draft with the anchor as the given token (sample_from_anchor=false) "
                                  f"only")
            return dflash2_read(config, where + ": DFlash2SpeculatorConfig", SPECULATORS_DFLASH2)
        if view == VIEW_VLLM_SPECULATORS:  # update_dflash2 copies the fields that are set into dflash_config
            return dflash2_read({k: config[k] for k in DFLASH2_FIELDS if config.get(k) is not None},
                                where.replace("qwen3_dflash.py", "qwen3_dflash2.py"))
        if view == VIEW_SGLANG:
            # parse_dflash_draft_config (not read here) is modelled as dflash_config's four fields, none defaulted:
            # where z-lab's published DFlash2 checkpoint has them and the zlab layout writes them
            return dflash2_read(config["dflash_config"], where + ": dflash_config")
        if view == VIEW_VLLM_ZLAB:
            return dflash2_read(config["dflash_config"], "vLLM (qwen3_dflash2.py): dflash_config")
        return {}

    def gguf_read(self, fields: Dict) -> Dict:
        """src/models/dflash.cpp load_arch_tensors creates the convolutions and the selector only when the GGUF holds
        `selector_hidden.weight` (then dflash.conv_kernel_size, conv_group_size, selector_rank and selector_top_k
        must each be > 0, or it refuses to load); without it the fields build nothing (plain DFlash)."""
        if "selector_hidden.weight" not in fields["__tensors__"]:
            return {}
        return {key: int(fields.get(f"dflash.{key}", 0)) for key in DFLASH2_FIELDS}

    def gguf_problems(self, fields: Dict) -> List[str]:
        """src/models/dflash.cpp load_arch_tensors, common/speculative.cpp draft: selector_top_k > 0 walks a lattice
        that only selector_hidden.weight builds, which then needs every field > 0 and K (K + 1) <= the width."""
        top_k, width = fields.get("dflash.selector_top_k", 0), fields.get("dflash.embedding_length", 0)
        if "selector_hidden.weight" not in fields["__tensors__"]:
            return [] if not top_k else [
                f"selector_top_k: the GGUF sets dflash.selector_top_k={top_k} without selector_hidden.weight: "
                f"common/speculative.cpp walks a lattice src/models/dflash.cpp never builds ('DFlash2 selector "
                f"produced no lattice')"]
        built = {key: int(fields.get(f"dflash.{key}", 0)) for key in DFLASH2_FIELDS}
        lines = [f"{key}: dflash.{key}={value}; src/models/dflash.cpp refuses a DFlash2 GGUF without it ('DFlash2 "
                 f"model is missing conv/selector metadata')" for key, value in built.items() if value <= 0]
        if top_k * (top_k + 1) > width:
            fits = max((k for k in range(1, width + 1) if k * (k + 1) <= width), default=0)
            lines.append(f"selector_top_k: {top_k}; llama.cpp packs each slot's K candidates and K x K scores into "
                         f"one hidden-wide row, K (K + 1) = {top_k * (top_k + 1)} > hidden_size {width} ('DFlash2 "
                         f"hidden size is too small for the selector lattice', src/models/dflash.cpp): train "
                         f"model.selector_top_k <= {fits}")
        return lines

    def vllm_loaded(self, hf) -> Dict:
        """DFlash2DraftModel (qwen3_dflash2.py): int(dflash_config[key]) for each field."""
        return {key: int(hf.dflash_config[key]) for key in DFLASH2_FIELDS}

    def refusals(self, cfg: DrafterConfig, fmt: str) -> List[str]:  # noqa: ARG002 (a hook)
        """One addition alone (speculators' DFlash2SpeculatorConfig, vLLM's and z-lab's DFlash2DraftModel build both,
        each of size >= 1), or drafting from the anchor (speculators' DFlash2 and vLLM's walk start from the given
        anchor token)."""
        problems = [f"{key}=0: {HINTS[key]}" for key in ("conv_kernel_size", "selector_rank") if not getattr(cfg, key)]
        if cfg.sample_from_anchor:
            problems.append("sample_from_anchor=true: speculators' DFlash2 and vLLM's dflash2 draft the block after "
                            "the given anchor token only (train model.sample_from_anchor=false)")
        return problems

    def card_row(self, cfg: DrafterConfig) -> Optional[Tuple[str, str]]:
        return ("DFlash2", f"{cfg.conv_kernel_size}-tap convolutions in groups of {cfg.conv_group_size}, a selector "
                           f"of rank {cfg.selector_rank} over the unary top {cfg.selector_top_k} (vLLM: its V2 model "
                           f"runner)")


LAYOUT = DFlash2()
