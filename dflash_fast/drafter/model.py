"""A drafter of any family, built and measured (spec.md §3-6): the families, `build_drafter`, the metrics' sums.

`DFlashDrafter` (backbone.py) is the DFlash family and the backbone every family shares; each other family is a
subclass in its own module: DSpark (spec.md §8, `markov_rank > 0` or `confidence_head`) in dspark.py, DFlash2
(spec.md §9, `conv_kernel_size > 0` or `selector_rank > 0`) in dflash2.py. Importing this module imports every
family (through weights.py, which imports families.py), so `DFlashDrafter(cfg)` builds the one `cfg.family`
names. Where every slot's teacher lives: targets.py;
the architecture: config.DrafterConfig; the decoder layer: layers.DecoderLayer; the weights read from files:
weights.py.
"""
from typing import Dict, List, Optional

import torch

from dflash_fast.drafter.backbone import DFlashDrafter, DrafterOutput
from dflash_fast.drafter.config import DrafterConfig
from dflash_fast.drafter.weights import check_drafter_fits_target, load_frozen_tensors

# A target whose tokenizer has no mask token and no spare embedding row (SmolLM2, Llama-2, ...) embeds the mask
# slots with the first of these special tokens it has: speculators' order (speculators/train/utils.py
# resolve_mask_token_id). The row is frozen and only ever embedded at draft slots, so any row works that the drafter
# sees nowhere else as a draft slot's input; the export writes the id, so every engine embeds the same row.
MASK_FALLBACKS = ("pad_token_id", "eos_token_id", "unk_token_id")


def resolve_mask_token_id(vocab_size: int, mask_token_id: Optional[int] = None, tokenizer=None) -> int:
    """`model.mask_token_id`, else the tokenizer's mask token, else the last embedding row the
    tokenizer does not use (targets such as Qwen3 pad their embedding beyond the tokenizer), else the tokenizer's
    pad, eos or unk token (MASK_FALLBACKS)."""
    if mask_token_id is None and tokenizer is not None and tokenizer.mask_token_id is not None:
        mask_token_id = tokenizer.mask_token_id
    if mask_token_id is None and tokenizer is not None and len(tokenizer) < vocab_size:
        mask_token_id = vocab_size - 1
    if mask_token_id is None and tokenizer is not None:
        mask_token_id = next((getattr(tokenizer, name, None) for name in MASK_FALLBACKS
                              if getattr(tokenizer, name, None) is not None), None)
    if mask_token_id is None:
        raise ValueError(
            f"no mask token: the tokenizer has no mask, pad, eos or unk token and uses all {vocab_size} embedding "
            f"rows; set model.mask_token_id"
        )
    if not 0 <= mask_token_id < vocab_size:
        raise ValueError(f"mask token id {mask_token_id} is outside the target embedding (0..{vocab_size - 1})")
    return mask_token_id


def slot_metrics(out: DrafterOutput) -> Dict[str, torch.Tensor]:
    """Sums for spec.md §6 metrics (reduce across ranks, then divide): acc_hits/acc_count [B] per slot,
    alpha_sum [B] (acceptance estimates of the valid slots, over acc_count), tau_sum (sum over valid blocks
    of 1 + leading matches), blocks (valid block count)."""
    match = (out.draft_argmax == out.teacher_argmax) & out.slot_mask
    first = out.first_slot
    # an anchor is eligible only if its first predicting slot trains (spec.md §3)
    valid_block = out.slot_mask[..., first]
    leading = match[..., first:].long().cumprod(-1).sum(-1)
    return {
        "acc_hits": match.flatten(0, 1).sum(0).float(),
        "acc_count": out.slot_mask.flatten(0, 1).sum(0).float(),
        "alpha_sum": (out.alpha * out.slot_mask).flatten(0, 1).sum(0).float(),
        "tau_sum": ((1 + leading) * valid_block).sum().float(),
        "blocks": valid_block.sum().float(),
    }


def build_drafter(
    target_path: str,
    layer_ids: List[int],
    mask_token_id: Optional[int] = None,
    norm_kind: Optional[str] = None,
    frozen_dtype: torch.dtype = torch.float32,
    **options,
) -> DFlashDrafter:
    """A fresh drafter for the target at `target_path` with its frozen tensors loaded in `frozen_dtype`
    (`norm_kind`: see load_frozen_tensors). Trainable weights are fp32 whatever `frozen_dtype` is;
    loading the [V, H] embedding and lm_head straight in the compute dtype spares every rank an fp32 copy."""
    from transformers import AutoConfig, AutoTokenizer

    target_config = AutoConfig.from_pretrained(target_path)
    vocab = (target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config).vocab_size
    tokenizer = None
    if mask_token_id is None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(target_path)
        except (OSError, ValueError):
            tokenizer = None
    cfg = DrafterConfig.from_target(
        target_config, layer_ids, resolve_mask_token_id(vocab, mask_token_id, tokenizer), **options
    )
    check_drafter_fits_target(cfg, target_path)
    drafter = DFlashDrafter(cfg, frozen_dtype)
    drafter.set_frozen(**load_frozen_tensors(target_path, frozen_dtype, norm_kind=norm_kind))
    return drafter
