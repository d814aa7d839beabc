"""Layer ids (spec.md §1): which decoder layers a store taps, the default choice, and how the CLI spells them.

Layer id `l` is the output of decoder layer `l`, `0 <= l <= L-1`; in Hugging Face `outputs.hidden_states` that is
`hidden_states[l + 1]` (target.LayerTaps applies the rule). Every stage that takes layer ids (extraction,
export, evaluation) checks them here, and a store's manifest records LAYER_ID_CONVENTION beside them.
"""
from typing import List, Sequence

import numpy as np

LAYER_ID_CONVENTION = (
    "layer id l = output of decoder layer l = HF hidden_states[l+1] "
    "(hidden_states[0] is the embedding output); 0 <= l <= L-1; "
    "id L-1 is stored before the final norm, like `last`"
)


def default_layer_ids(num_layers: int, num_tapped: int = 5) -> List[int]:
    """`num_tapped` ids spread uniformly from layer 1 to layer `num_layers - 3`, rounded.

    36 -> [1, 9, 17, 25, 33]; 64 -> [1, 16, 31, 46, 61]. One tapped layer is
    the middle one. Raises when the target is too shallow for distinct ids.
    """
    if num_tapped < 1:
        raise ValueError(f"num_tapped must be >= 1, got {num_tapped}")
    if num_tapped == 1:
        return [num_layers // 2]
    start, end = 1, num_layers - 3
    ids = [int(round(start + i * (end - start) / (num_tapped - 1))) for i in range(num_tapped)]
    if end <= start or len(set(ids)) != num_tapped:
        raise ValueError(
            f"cannot spread {num_tapped} distinct layer ids over 1..{end} of a {num_layers}-layer target; "
            f"pass fewer (--num-tapped) or explicit ids (--layer-ids)"
        )
    return ids


def check_layer_ids(layer_ids: Sequence[int], num_layers: int) -> List[int]:
    """Validate layer ids against a target of `num_layers` decoder layers; never clamp.

    Ids must be integers in 0..L-1, unique and sorted ascending. Returns them as a list.
    """
    ids = list(layer_ids)
    if not ids:
        raise ValueError("layer ids are empty: give at least one decoder layer id")
    for i in ids:
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
            raise ValueError(f"layer id {i!r} is not an integer")
        if i < 0:
            raise ValueError(
                f"layer id {i} is negative: ids count decoder layers from 0 "
                f"(the target has {num_layers}, ids 0..{num_layers - 1}); negative indexing is not allowed"
            )
        if i >= num_layers:
            raise ValueError(
                f"layer id {i} does not exist: the target has {num_layers} decoder layers "
                f"(ids 0..{num_layers - 1}); HF hidden_states[i+1] is layer i, and hidden_states[0] "
                f"is the embedding output, not a layer"
            )
    if len(set(ids)) != len(ids):
        raise ValueError(f"layer ids {ids} contain duplicates: each layer can be tapped once")
    if ids != sorted(ids):
        raise ValueError(f"layer ids {ids} are not sorted ascending: pass {sorted(ids)}")
    return [int(i) for i in ids]


def parse_layer_ids(text: str) -> List[int]:
    """'1,9,17' -> [1, 9, 17] (validated later against the target)."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--layer-ids {text!r}: expected comma-separated integers such as 1,9,17,25,33") from None
