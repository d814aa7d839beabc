"""LiLiCorr (spec.md §11, docs/lilicorr.md) on the serving side: the z-lab layout as architectures
["LiLiCorrDraftModel"] (vLLM's `dflash` method with its LiLiCorrForCausalLM, V2 runner), read by vLLM alone: SGLang's
LiLiCorr (sgl-project/sglang#37462, which vLLM's head was ported from) is an open pull request whose revisions
disagree on our lattice tensor names, so no SGLang view is modelled (docs/lilicorr.md, "SGLang": what it reads, and
what modelling it needs), and speculators has no LiLiCorr model. Its config carries lilicorr_enabled, the eight
lilicorr_* fields and, with DFlash2's convolutions, conv_kernel_size and conv_group_size in dflash_config,
has_own_lm_head false, and the lattice head's tensors lilicorr.* (vLLM's LiLiCorrHead names). Every other
engine's view builds no lattice (`off`), so a LiLiCorr drafter written as plain DFlash or DFlash2 reads as a
mismatch."""
from typing import Dict, List, Optional, Tuple

from dflash_fast.drafter.config import DrafterConfig, DrafterOptions, lilicorr_problems
from dflash_fast.errors import BOOL, INT, NUMBER, Nullable, is_int
from dflash_fast.serve.families.base import VIEW_VLLM_ZLAB, ExportError, FamilyLayout
from dflash_fast.serve.families.dflash2 import CONV_FIELDS, DFLASH2_OFF, dflash2_fields

# LiLiCorr's fields (spec.md §11) under the names vLLM's LiLiCorrHead reads from dflash_config (lilicorr.py)
LILICORR_FIELDS = tuple(key for key in DrafterOptions.names() if key.startswith("lilicorr_"))
LILICORR_OFF = {key: getattr(DrafterOptions, key) for key in LILICORR_FIELDS}
_REALS = ("lilicorr_mlp_ratio", "lilicorr_vector_eps", "lilicorr_logit_scale")


def lilicorr_fields(values: Dict, hidden_size) -> Dict:
    """LiLiCorr's fields of `ARCHITECTURE` (LILICORR_FIELDS) as its head is built: the lattice width
    lilicorr_hidden_size, 0 read as the drafter's hidden size (vLLM's LiLiCorrHead: `config[...] or
    model_hidden_size`); with lilicorr_candidate_topk 0 (no lattice) every other field is moot and reads as
    DrafterOptions' default."""
    if not values["lilicorr_candidate_topk"]:
        return dict(LILICORR_OFF)
    return dict(values, lilicorr_hidden_size=values["lilicorr_hidden_size"] or hidden_size)


def _convolutions(taps, group) -> Dict:
    return dflash2_fields(taps, group, 0, 16) if taps else DFLASH2_OFF


def _vllm_lilicorr(config: Dict, hf) -> Dict:
    """vLLM 0.32 serving architectures ["LiLiCorrDraftModel"] (model_executor/models/lilicorr.py; its `dflash` method
    picks LiLiCorrSpeculator by that name, v1/worker/gpu/spec_decode/__init__.py): DFlash2's fields and LiLiCorr's
    (`lilicorr_fields`), refusing, with the field named, what vLLM refuses or would serve otherwise than trained:
    lilicorr_enabled false; a lilicorr_* key absent (LiLiCorrHead reads each as config[key]); a K other than a power
    of two <= 16, heads not dividing the lattice width (LiLiCorrHead, LiLiCorrLatticeAttention raise); one
    convolution field without the other (LiLiCorr.__init__); a block with no slot to draft (vLLM needs 1 <=
    num_speculative_tokens < block_size); a draft vocabulary other than the target's (LiLiCorrForCausalLM: "LiLiCorr
    candidates require the full target vocabulary", no d2t map); has_own_lm_head true (the candidates would be
    an lm_head.weight of the checkpoint's, ours are the target's)."""
    where = "vLLM (lilicorr.py, LiLiCorrDraftModel) cannot serve this config.json as it trained:"
    dflash = config["dflash_config"]
    problems = []
    if not dflash.get("lilicorr_enabled", True):
        problems.append(f"dflash_config.lilicorr_enabled={dflash['lilicorr_enabled']!r}: vLLM raises "
                        f"(\"LiLiCorr requires lilicorr_enabled=True\"); write true")
    absent = [key for key in LILICORR_FIELDS if key not in dflash]
    if absent:
        problems.append(f"dflash_config has no {absent}: vLLM's LiLiCorrHead reads each, with no default")
    values = {key: dflash.get(key) for key in LILICORR_FIELDS}
    if not absent:
        if values["lilicorr_candidate_topk"] == 0:
            problems.append("dflash_config.lilicorr_candidate_topk=0: vLLM's LiLiCorrHead needs a power of two <= 16")
        problems += [f"dflash_config.{line}" for line in lilicorr_problems({**values, "hidden_size": hf.hidden_size})]
        block = dflash.get("block_size", config.get("block_size", 0))  # LiLiCorr.__init__'s reading
        if not is_int(block) or block < 2:
            problems.append(f"dflash_config.block_size={block!r}: vLLM needs 1 <= num_speculative_tokens < "
                            f"block_size, the trained block (>= 2)")
    taps, group = dflash.get(CONV_FIELDS[0], 0), dflash.get(CONV_FIELDS[1], 0)
    if not (is_int(taps) and is_int(group)) or taps < 0 or group < 0 or bool(taps) != bool(group):
        problems.append(f"dflash_config.conv_kernel_size={taps!r}, conv_group_size={group!r}: vLLM's LiLiCorr builds "
                        f"DFlash2's convolutions with both >= 1 or neither (0 or absent)")
    draft_vocab = config.get("draft_vocab_size")
    if draft_vocab is not None and draft_vocab != hf.vocab_size:
        problems.append(f"draft_vocab_size={draft_vocab} of a {hf.vocab_size}-token vocabulary: LiLiCorr's candidates "
                        f"need the target's full vocabulary (vLLM refuses a draft-to-target map)")
    if config.get("has_own_lm_head"):
        problems.append("has_own_lm_head=true: vLLM would draw the candidates from an lm_head.weight of the export, "
                        "dflash-fast's drafter drafts through the target's lm_head (write false)")
    if problems:
        raise ExportError(where + "\n  - " + "\n  - ".join(problems))
    return {**_convolutions(taps, group), **lilicorr_fields(values, hf.hidden_size)}


class LiLiCorr(FamilyLayout):
    name = "lilicorr"
    short = "LiLiCorr"
    title = "LiLiCorr (DFlash backbone with a candidate-lattice correlator)"
    speculators_architecture = None
    zlab_architecture = "LiLiCorrDraftModel"
    engines = ("vllm",)  # not SGLang: docs/lilicorr.md, "SGLang"
    vllm_v2 = True
    off = LILICORR_OFF
    hints = {"lilicorr_candidate_topk": "only vLLM's LiLiCorrDraftModel builds the lattice head (the zlab layout as "
             "architectures ['LiLiCorrDraftModel']); any other architecture serves the backbone alone, as plain "
             "DFlash(2)"}
    # vLLM's LiLiCorrHead: int sizes, float ratio, eps and scale; lilicorr_enabled a flag
    schema = {"dflash_config": {"lilicorr_enabled": Nullable(BOOL),
                                **{key: NUMBER if key in _REALS else INT for key in LILICORR_FIELDS}},
              "zlab": {"has_own_lm_head": Nullable(BOOL)}}

    def fields(self, cfg: DrafterConfig) -> Dict:
        return lilicorr_fields({key: getattr(cfg, key) for key in LILICORR_FIELDS}, cfg.hidden_size)

    def zlab_fields(self, cfg: DrafterConfig) -> Tuple[Dict, Dict]:
        """lilicorr_enabled and the eight fields (vLLM's LiLiCorrHead reads each as config[key], no default) and, with
        convolutions, their two fields (LiLiCorr.__init__); its candidates are the target's lm_head's:
        has_own_lm_head false (vLLM's LiLiCorrForCausalLM would otherwise require and use an lm_head.weight)."""
        conv = {key: getattr(cfg, key) for key in CONV_FIELDS} if cfg.conv_kernel_size else {}
        return ({"has_own_lm_head": False},
                {"lilicorr_enabled": True, **{key: getattr(cfg, key) for key in LILICORR_FIELDS}, **conv})

    def read(self, view: Tuple[str, str], config: Dict, hf, where: str) -> Dict:  # noqa: ARG002 (a hook)
        return _vllm_lilicorr(config, hf) if view == VIEW_VLLM_ZLAB else {}

    def vllm_loaded(self, hf) -> Dict:
        """LiLiCorrDraftModel (lilicorr.py): the convolutions when dflash_config has conv_kernel_size and
        LiLiCorrHead's config[key] for each lilicorr field."""
        dflash = hf.dflash_config
        return {**_convolutions(*(dflash.get(key, 0) for key in CONV_FIELDS)),
                **lilicorr_fields({key: dflash[key] for key in LILICORR_FIELDS}, hf.hidden_size)}

    def refusals(self, cfg: DrafterConfig, fmt: str) -> List[str]:
        if fmt == "zlab":
            return []
        return [f"lilicorr_candidate_topk={cfg.lilicorr_candidate_topk}: speculators has no LiLiCorr model and vLLM's "
                f"speculators adapter no lilicorr type; export --format zlab (vLLM's LiLiCorrDraftModel, "
                f"docs/lilicorr.md)"]

    def card_row(self, cfg: DrafterConfig) -> Optional[Tuple[str, str]]:
        conv = (f", {cfg.conv_kernel_size}-tap convolutions in groups of {cfg.conv_group_size}"
                if cfg.conv_kernel_size else "")
        return ("LiLiCorr", f"a lattice of the top {cfg.lilicorr_candidate_topk} candidates per slot, "
                            f"{cfg.lilicorr_num_layers} layers of width {cfg.lilicorr_hidden_size or cfg.hidden_size}"
                            f"{conv} (vLLM: its V2 model runner)")


LAYOUT = LiLiCorr()
