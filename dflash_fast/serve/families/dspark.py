"""DSpark (spec.md §8) on the serving side: the speculators layout's `dspark` type (vLLM's `dspark` method), read by
speculators and vLLM; the z-lab layout has no DSpark heads (a DSpark drafter written there reads as plain DFlash, a
mismatch on markov_rank); llama.cpp converts its speculators export to a GGUF (`gguf_read`)."""
from typing import Dict, Tuple

from dflash_fast.drafter.config import DFLASH_ONLY, DrafterConfig
from dflash_fast.errors import is_int
from dflash_fast.serve.families.base import VIEW_SPECULATORS, VIEW_VLLM_SPECULATORS, ExportError, FamilyLayout


def dspark_fields(sample_from_anchor, markov_rank, markov_head_type, confidence_head, with_markov) -> Dict:
    """The DSpark fields of `ARCHITECTURE`; without a confidence head its input is moot and reads as true."""
    return dict(sample_from_anchor=sample_from_anchor, markov_rank=markov_rank, markov_head_type=markov_head_type,
                confidence_head=confidence_head, confidence_head_with_markov=with_markov or not confidence_head)


def _speculators_dspark(config: Dict) -> Dict:
    """speculators' DSparkSpeculatorConfig (models/dspark/config.py) defaults: sample_from_anchor true, markov_rank
    256, vanilla, enable_confidence_head true, confidence_head_with_markov true; DSparkDraftModel builds no Markov
    head at markov_rank 0."""
    return dspark_fields(
        bool(config.get("sample_from_anchor", True)),
        config.get("markov_rank", 256),
        config.get("markov_head_type", "vanilla"),
        bool(config.get("enable_confidence_head", True)),
        bool(config.get("confidence_head_with_markov", True)),
    )


def _vllm_dspark(config: Dict, where: str) -> Dict:
    """vLLM's dspark method: algos.py update_dspark surfaces markov_rank, markov_head_type, enable_confidence_head,
    confidence_head_with_markov and dspark_bonus_anchor = not sample_from_anchor (default true); qwen3_dspark.py
    always builds a vanilla DSparkMarkovHead of markov_rank (W1[prev] -> W2, no gate or recurrence), the confidence
    head only with enable_confidence_head (default false), reading [hidden, W1[prev]] only with
    confidence_head_with_markov (default false)."""
    rank = config.get("markov_rank")
    if not is_int(rank) or rank < 1:
        raise ExportError(f"{where}: markov_rank={rank!r}; vLLM's DSpark builds a Markov head of that rank (>= 1)")
    return dspark_fields(
        bool(config.get("sample_from_anchor", True)),
        rank,
        "vanilla",
        bool(config.get("enable_confidence_head", False)),
        bool(config.get("confidence_head_with_markov", False)),
    )


class DSpark(FamilyLayout):
    name = "dspark"
    short = "DSpark"
    title = "DSpark (DFlash backbone with DSpark heads)"
    speculators_architecture = "DSparkDraftModel"
    zlab_architecture = None
    vllm_method = "dspark"
    vllm_v2 = True
    off = DFLASH_ONLY
    hints = {
        "markov_head_type": "vLLM's DSpark (qwen3_dspark.py, DSparkMarkovHead) serves the vanilla Markov head only: "
        "train model.markov_head_type=vanilla to serve with vLLM",
        "markov_rank": "the z-lab layout (SGLang's and vLLM's dflash method) has no DSpark heads: export a DSpark "
        "drafter in the speculators format",
    }

    # gguf-py tensor_mapping.py DSPARK_MARKOV_W1, DSPARK_MARKOV_W2, DSPARK_CONF_PROJ
    gguf_tensors = {
        "markov_head.markov_w1.weight": "markov_w1.weight",
        "markov_head.markov_w2.weight": "markov_w2.weight",
        "confidence_head.proj.weight": "conf_proj.weight",
        "confidence_head.proj.bias": "conf_proj.bias",
    }

    def gguf_read(self, fields: Dict) -> Dict:
        """llama.cpp's DSpark (llama-cpp-python 0.3.36's vendored tree): src/models/dflash.cpp builds the Markov
        head when the GGUF holds markov_w1.weight, of its rank (ne[0]), vanilla (build_dspark_markov_head: logits +
        W2 W1[prev], prev the anchor then each slot's argmax; conversion/qwen.py DSparkModel refuses another
        markov_head_type), and the confidence head when it holds conf_proj.weight, of [n_embd + rank] (the normed
        hidden state beside W1[prev]: with the Markov input), read only with --spec-draft-p-min > 0;
        `dflash.sample_from_anchor` (true when absent: common/speculative.cpp, dflash.cpp) picks B drafted slots
        after the anchor or the anchor's slot as the given token. Without markov_w1.weight it is draft-dflash."""
        shapes = fields.get("__shapes__", {})
        if "markov_w1.weight" not in shapes:
            return {}
        return dspark_fields(bool(fields.get("dflash.sample_from_anchor", True)), int(shapes["markov_w1.weight"][0]),
                             "vanilla", "conf_proj.weight" in shapes, True)

    def fields(self, cfg: DrafterConfig) -> Dict:
        return dspark_fields(*(getattr(cfg, key) for key in DFLASH_ONLY))

    def speculators_fields(self, cfg: DrafterConfig) -> Dict:
        """DSparkSpeculatorConfig's names (sample_from_anchor is every drafter's, written by the layout)."""
        return {
            "markov_rank": cfg.markov_rank,
            "markov_head_type": cfg.markov_head_type,
            "enable_confidence_head": cfg.confidence_head,
            "confidence_head_with_markov": cfg.confidence_head_with_markov,
        }

    def read(self, view: Tuple[str, str], config: Dict, hf, where: str) -> Dict:  # noqa: ARG002 (a hook)
        if view == VIEW_SPECULATORS:
            return _speculators_dspark(config)
        if view == VIEW_VLLM_SPECULATORS:
            return _vllm_dspark(config, where)
        return {}


LAYOUT = DSpark()
