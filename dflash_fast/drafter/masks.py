"""The mask rules the eager twin and the attention kernel share (spec.md §3-4): where each document starts in a
packed row, and which sliding-window rules exist and what they require of the window.
"""

from typing import Optional

import torch


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """[R, T] document ids (contiguous runs) -> [R, T] index of each token's document start."""
    r, t = document_ids.shape
    pos = torch.arange(t, device=document_ids.device).expand(r, t)
    new_doc = torch.ones_like(document_ids, dtype=torch.bool)
    new_doc[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return torch.where(new_doc, pos, torch.zeros_like(pos)).cummax(dim=1).values


# Where a sliding window's W context keys end (model.window_from): "anchor" is spec.md §4 (every slot of a block sees
# a-W..a-1, as speculators 0.9.0 trains); "query" is the window of each query's own position a+j, keys p > a+j-W
# (what vLLM, SGLang and z-lab's inference serve: docs/vllm.md "Sliding windows").
WINDOW_RULES = ("anchor", "query")


def check_window(window: Optional[int], window_from: str, block_size: int) -> None:
    """The window arguments both twins take: a rule of WINDOW_RULES, and with the query rule a window that
    holds the whole block (the engines would window the block's own keys too, which neither twin does)."""
    if window_from not in WINDOW_RULES:
        raise ValueError(f"window_from={window_from!r} is not one of {WINDOW_RULES}")
    if window_from == "query" and window is not None and window < block_size:
        raise ValueError(f"window_from='query' with window {window} < block_size {block_size}: the engines then "
                         "window the block's own keys too; use a window >= block_size")
