"""The drafter's architecture (spec.md §3-5, §8): `DrafterConfig`, built from the target's config, and the value rules
every drafter config read from a file goes through (`value_problems`: a config built from a target, a checkpoint
marker's, an export's architecture)."""
import dataclasses
import math
from typing import Dict, List, Mapping, Optional, Union

from dflash_fast.drafter.masks import WINDOW_RULES, check_window
from dflash_fast.errors import is_int

LAYER_KINDS = ("full", "sliding")
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")  # DSpark's Markov heads (spec.md §8, dspark.MarkovHead)
# Sizes and counts of a DrafterConfig and the least value each may take: 1 for the sizes, 2 for the block (the given
# token and one to draft), 0 for the mask token (a token id).
SIZE_FIELDS = {
    **dict.fromkeys(("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                     "vocab_size", "target_hidden_size", "target_num_layers", "max_position_embeddings",
                     "num_layers"), 1),
    "block_size": 2,
    "mask_token_id": 0,
}
# The block is the one size no weight backs (every slot of every anchor is a query row): published DFlash drafters use
# 16 and no verifier step accepts hundreds of drafted tokens, so a larger block is a typo or a forged file.
MAX_BLOCK_SIZE = 256
# The DSpark fields of a DFlash drafter (DrafterConfig's defaults): a drafter whose DSpark fields all equal these is no
# DSpark (DrafterConfig.family); what a view of a DFlash-only layout serves.
DFLASH_ONLY = dict(sample_from_anchor=False, markov_rank=0, markov_head_type="vanilla", confidence_head=False,
                   confidence_head_with_markov=True)


@dataclasses.dataclass
class DrafterOptions:
    """The drafter's architecture options, their one definition: the `model.*` keys a training config sets (the
    train config's ModelConfig is these plus its own), what `DrafterConfig.from_target` takes beside the target's
    sizes, and (with those sizes) what an export's architecture carries. Their value rules: `value_problems` and
    `DrafterConfig.__post_init__`."""

    num_layers: int = 5
    block_size: int = 16
    layer_types: Optional[List[str]] = None  # per drafter layer "full" | "sliding"; None = all full
    sliding_window: Optional[int] = None
    # Where a sliding window's keys end: "anchor" (spec.md §4, speculators' training) or "query" (each slot's own
    # position: what vLLM and SGLang serve; docs/training.md, Sliding windows)
    window_from: str = "anchor"
    causal_in_block: bool = False  # a config's one flag for every layer (DrafterConfig keeps one per layer)
    # DSpark (spec.md §8, docs/dspark.md): the DFlash backbone plus a Markov logit bias and a confidence head; the
    # defaults are DFlash (DFLASH_ONLY).
    sample_from_anchor: bool = False  # slot j predicts the token at anchor + j + 1 (slot 0 included); DSpark's default
    markov_rank: int = 0  # rank r of the Markov bias W2 W1[previous token]; 0 = none (DFlash)
    markov_head_type: str = "vanilla"  # vanilla | gated | rnn
    confidence_head: bool = False  # predict each slot's acceptance rate (trained with loss.confidence_alpha)
    confidence_head_with_markov: bool = True  # the confidence head reads [hidden, W1[prev]] (needs markov_rank > 0)
    # DFlash2 (spec.md §9, docs/dflash2.md): the DFlash backbone plus dynamic convolutions and a candidate selector;
    # 0 = off (DFlash). DFlash2's own defaults: taps 2, group 16, rank 256, top-K 16.
    conv_kernel_size: int = 0  # taps of the causal convolutions inside each block (<= block_size); 0 = none
    conv_group_size: int = 16  # hidden channels sharing one dynamic coefficient; divides the hidden size
    selector_rank: int = 0  # rank r of the candidate selector's codebooks P, S [V, r]; 0 = none
    selector_top_k: int = 16  # K unary candidates the selector re-ranks; <= vocab_size
    # LiLiCorr (spec.md §11, docs/lilicorr.md): the DFlash backbone (with or without DFlash2's convolutions) plus the
    # candidate-lattice correlator; lilicorr_candidate_topk 0 = off. The names are vLLM 0.32's `dflash_config` keys.
    lilicorr_candidate_topk: int = 0  # K candidates per drafted slot: a power of two <= 16
    lilicorr_hidden_size: int = 0  # the lattice transformer's width; 0 = the drafter's hidden size
    lilicorr_num_heads: int = 4
    lilicorr_num_layers: int = 2
    lilicorr_mlp_ratio: float = 2.0
    lilicorr_factor_dim: int = 64
    lilicorr_vector_eps: float = 1e-6
    lilicorr_logit_scale: float = 10.0

    @classmethod
    def names(cls):
        """The option keys, in their order."""
        return tuple(f.name for f in dataclasses.fields(DrafterOptions))

    def options(self) -> Dict:
        """The option values by key (what `DrafterConfig.from_target` takes)."""
        return {key: getattr(self, key) for key in DrafterOptions.names()}


@dataclasses.dataclass(kw_only=True)
class DrafterConfig(DrafterOptions):
    """Architecture of the drafter: its options (DrafterOptions) and the sizes, RoPE and ids the target gives;
    built from the target's config by `from_target`."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    layer_ids: List[int]  # target layer ids tapped (spec.md §1 convention: HF hidden_states[id + 1])
    target_num_layers: int
    target_hidden_size: int
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_parameters: Dict = dataclasses.field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 32768
    causal_in_block: Union[bool, List[bool]] = False  # one flag for every layer, or one per layer (kept as a list)
    target_model_type: str = ""

    def __post_init__(self):
        problems = value_problems(dataclasses.asdict(self))
        if problems:
            raise ValueError("; ".join(problems))
        if self.layer_types is None:
            self.layer_types = ["full"] * self.num_layers
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} drafter layers")
        for kind in self.layer_types:
            if kind not in LAYER_KINDS:
                raise ValueError(f"drafter layer kind {kind!r} is not one of {LAYER_KINDS}")
        if "sliding" in self.layer_types and not self.sliding_window:
            raise ValueError("a 'sliding' drafter layer needs sliding_window > 0")
        if "sliding" in self.layer_types:
            check_window(self.sliding_window, self.window_from, self.block_size)
        if isinstance(self.causal_in_block, bool):
            self.causal_in_block = [self.causal_in_block] * self.num_layers
        self.causal_in_block = list(self.causal_in_block)
        if len(self.causal_in_block) != self.num_layers or not all(isinstance(c, bool) for c in self.causal_in_block):
            raise ValueError(
                f"causal_in_block={self.causal_in_block!r}: give true/false, or one true/false per drafter layer "
                f"({self.num_layers})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{self.num_attention_heads} query heads are not a multiple of {self.num_key_value_heads} kv heads"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask token id {self.mask_token_id} is outside the embedding (0..{self.vocab_size - 1})")
        if self.markov_rank < 0 or self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(
                f"markov_rank={self.markov_rank} must be >= 0 and markov_head_type={self.markov_head_type!r} one of "
                f"{MARKOV_HEAD_TYPES}"
            )
        if self.confidence_head and self.confidence_head_with_markov and not self.markov_rank:
            raise ValueError("confidence_head_with_markov needs the Markov head: set markov_rank > 0 or the flag false")
        if (self.conv_kernel_size or self.selector_rank) and (self.markov_rank or self.confidence_head):
            raise ValueError("DFlash2's convolutions or selector (conv_kernel_size, selector_rank) with DSpark's heads "
                             "(markov_rank, confidence_head): choose one family")

    @property
    def family(self) -> str:
        """The drafter family the options describe: lilicorr (lilicorr_candidate_topk > 0, with or without DFlash2's
        convolutions, docs/lilicorr.md), dflash2 (either DFlash2 addition on, spec.md §9), dspark (a DSpark option
        other than DFlash's, spec.md §8) or dflash. `DFlashDrafter(cfg)` builds that family's class, and the export
        writes it as speculators_model_type."""
        if self.lilicorr_candidate_topk:
            return "lilicorr"
        if self.is_dflash2:
            return "dflash2"
        return "dspark" if any(getattr(self, key) != value for key, value in DFLASH_ONLY.items()) else "dflash"

    @property
    def is_dflash2(self) -> bool:
        """Either DFlash2 addition is on (spec.md §9)."""
        return bool(self.conv_kernel_size or self.selector_rank)

    @property
    def first_slot(self) -> int:
        """The first slot that predicts a token: 0 with sample_from_anchor, else 1 (slot 0 is given)."""
        return 0 if self.sample_from_anchor else 1

    @property
    def drafted_tokens(self) -> int:
        """The tokens a block drafts, the engines' num_speculative_tokens: B - 1, or B with sample_from_anchor; a
        verification block is these and the anchor."""
        return self.block_size - self.first_slot

    @property
    def num_tapped(self) -> int:
        return len(self.layer_ids)

    @classmethod
    def from_target(cls, target_config, layer_ids: List[int], mask_token_id: int, **options) -> "DrafterConfig":
        """Copy sizes, RoPE and eps from an HF target config (text sub-config of multimodal ones)."""
        tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        rope = dict(
            getattr(tc, "rope_parameters", None)
            or {"rope_type": "default", "rope_theta": getattr(tc, "rope_theta", 10000.0)}
        )
        if getattr(tc, "partial_rotary_factor", None) is not None:
            rope.setdefault("partial_rotary_factor", tc.partial_rotary_factor)
        intermediate = getattr(tc, "intermediate_size", None) or 4 * tc.hidden_size
        return cls(
            hidden_size=tc.hidden_size,
            num_attention_heads=tc.num_attention_heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
            head_dim=head_dim,
            intermediate_size=intermediate,
            vocab_size=tc.vocab_size,
            layer_ids=list(layer_ids),
            target_num_layers=tc.num_hidden_layers,
            target_hidden_size=tc.hidden_size,
            mask_token_id=mask_token_id,
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            rope_parameters=rope,
            max_position_embeddings=getattr(tc, "max_position_embeddings", 32768),
            target_model_type=getattr(tc, "model_type", ""),
            **options,
        )

    def to_dict(self) -> Dict:
        return dataclasses.asdict(self)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def value_problems(values: Mapping) -> List[str]:
    """What is wrong with the drafter fields in `values` (a DrafterConfig's, or an export's architecture with the
    same names), one `field=value is not ...` line each: the one home of the drafter's value rules, for configs
    built from a target, read from a checkpoint marker or from an export."""
    problems = [
        f"{field}={values[field]!r} is not an integer >= {least}"
        for field, least in SIZE_FIELDS.items()
        if field in values and (not is_int(values[field]) or values[field] < least)
    ]
    block = values.get("block_size")
    if is_int(block) and block > MAX_BLOCK_SIZE:
        problems.append(f"block_size={block} is beyond {MAX_BLOCK_SIZE} (MAX_BLOCK_SIZE: no weight bounds the block)")
    eps = values.get("rms_norm_eps", 1e-6)
    if not _is_number(eps) or not 0 < eps < 1:
        problems.append(f"rms_norm_eps={eps!r} is not a number in (0, 1)")
    window = values.get("sliding_window")
    if window is not None and (not is_int(window) or window < 1):
        problems.append(f"sliding_window={window!r} is not an integer >= 1")
    window_from = values.get("window_from", "anchor")
    if window_from not in WINDOW_RULES:
        problems.append(f"window_from={window_from!r} is not one of {WINDOW_RULES}")
    rank, head = values.get("markov_rank", 0), values.get("markov_head_type", "vanilla")
    if not is_int(rank) or rank < 0:
        problems.append(f"markov_rank={rank!r} is not an integer >= 0")
    if not isinstance(head, str):
        problems.append(f"markov_head_type={head!r} is not a string")
    problems += dflash2_problems(values)
    problems += lilicorr_problems(values)
    rope = values.get("rope_parameters", {})
    if not isinstance(rope, dict):
        problems.append(f"rope_parameters={rope!r} is not an object")
    else:
        problems += rope_problems(rope)
    return problems


def dflash2_problems(values: Mapping) -> List[str]:
    """DFlash2's fields (spec.md §9): counts >= 0 (0 = off), a convolution whose taps fit the block and whose groups
    divide the hidden size, a selector whose K fits the vocabulary."""
    problems = [f"{field}={values[field]!r} is not an integer >= {least}"
                for field, least in (("conv_kernel_size", 0), ("conv_group_size", 1), ("selector_rank", 0),
                                     ("selector_top_k", 1))
                if field in values and (not is_int(values[field]) or values[field] < least)]
    if problems:
        return problems
    taps, group, h = values.get("conv_kernel_size", 0), values.get("conv_group_size", 16), values.get("hidden_size")
    block = values.get("block_size")
    if taps and is_int(block) and taps > block:
        problems.append(f"conv_kernel_size={taps} is more taps than the block has slots (block_size={block})")
    if taps and is_int(h) and h % group:
        problems.append(f"conv_group_size={group} does not divide hidden_size={h}: pick a divisor (DFlash2: 16)")
    top_k, vocab = values.get("selector_top_k", 16), values.get("vocab_size")
    if values.get("selector_rank", 0) and is_int(vocab) and top_k > vocab:
        problems.append(f"selector_top_k={top_k} is more candidates than the vocabulary has ({vocab})")
    return problems


MAX_LILICORR_TOP_K = 16  # vLLM 0.32's LiLiCorrHead: a power of two <= 16


def lilicorr_problems(values: Mapping) -> List[str]:
    """LiLiCorr's fields (docs/lilicorr.md) as vLLM 0.32 reads them, one line each; none when it is off
    (lilicorr_candidate_topk 0): K a power of two <= 16, heads dividing the lattice width, positive sizes, eps in
    (0, 0.5), a scale > 0, and no other family's head with it (vLLM builds none beside it)."""
    k = values.get("lilicorr_candidate_topk", 0)
    if not k:
        return []
    if not is_int(k) or k < 1 or k > MAX_LILICORR_TOP_K or k & (k - 1):
        return [f"lilicorr_candidate_topk={k!r} is not a power of two <= {MAX_LILICORR_TOP_K} (vLLM serves no other)"]
    problems = [f"{field}={values.get(field)!r} is not an integer >= {least}"
                for field, least in (("lilicorr_hidden_size", 0), ("lilicorr_num_heads", 1),
                                     ("lilicorr_num_layers", 1), ("lilicorr_factor_dim", 1))
                if not is_int(values.get(field, least)) or values.get(field, least) < least]
    if problems:
        return problems
    width = values.get("lilicorr_hidden_size", 0) or values.get("hidden_size")
    heads = values.get("lilicorr_num_heads", 4)
    if is_int(width) and width % heads:
        problems.append(f"lilicorr_num_heads={heads} does not divide the lattice width {width}")
    eps, scale = values.get("lilicorr_vector_eps", 1e-6), values.get("lilicorr_logit_scale", 10.0)
    ratio = values.get("lilicorr_mlp_ratio", 2.0)
    if not _is_number(eps) or not 0 < eps < 0.5:
        problems.append(f"lilicorr_vector_eps={eps!r} is not a number in (0, 0.5)")
    if not _is_number(scale) or scale <= 0:
        problems.append(f"lilicorr_logit_scale={scale!r} is not a number > 0")
    if not _is_number(ratio) or (is_int(width) and int(width * ratio) < 1):
        problems.append(f"lilicorr_mlp_ratio={ratio!r} gives the lattice MLP no width")
    if values.get("sample_from_anchor"):
        problems.append("sample_from_anchor=true with LiLiCorr: its lattice is the B - 1 slots after the given token")
    if values.get("selector_rank") or values.get("markov_rank") or values.get("confidence_head"):
        problems.append("LiLiCorr (lilicorr_candidate_topk) with DFlash2's selector or DSpark's heads: "
                        "choose one family")
    return problems


def rope_problems(rope: Mapping) -> List[str]:
    """RoPE parameters that would give NaN, infinite or meaningless rotations: every number finite, rope_theta and
    the scaling factors > 0, partial_rotary_factor in (0, 1]."""
    problems = [f"rope_parameters.{k}={v!r} is not a finite number"
                for k, v in rope.items() if isinstance(v, float) and not math.isfinite(v)]
    theta = rope.get("rope_theta", 10000.0)
    if not _is_number(theta) or theta <= 0:
        problems.append(f"rope_parameters.rope_theta={theta!r} is not a number > 0")
    for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "low_freq_factor",
                "high_freq_factor", "attention_factor"):
        if key in rope and rope[key] is not None and (not _is_number(rope[key]) or rope[key] <= 0):
            problems.append(f"rope_parameters.{key}={rope[key]!r} is not a number > 0")
    partial = rope.get("partial_rotary_factor", 1.0)
    if not _is_number(partial) or not 0 < partial <= 1:
        problems.append(f"rope_parameters.partial_rotary_factor={partial!r} is not a number in (0, 1]")
    return problems
