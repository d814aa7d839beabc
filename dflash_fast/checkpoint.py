"""Trainer checkpoints on disk: finding complete ones, their client state, RNG state, and the trained drafter.

    OUT/checkpoints/stepNNNNNNNN/   DeepSpeed's files + rng_rankNNNNN.pt + dflash_fast.json (step, data position,
                                    drafter config; written last, so its presence means "complete")

Used by the trainer (save / resume), `dflash-fast export` and `dflash-fast eval` (a checkpoint as the drafter).
"""
import glob
import json
import os
import random
import re
from typing import Dict, List, Tuple

import numpy as np
import torch

from dflash_fast.drafter import DFlashDrafter, DrafterConfig

CHECKPOINT_TAG = re.compile(r"^step(\d{8})$")
CLIENT_STATE = "dflash_fast.json"  # written last into a checkpoint: step, data position, drafter config


def checkpoint_tags(checkpoints_dir: str) -> List[str]:
    """Complete checkpoint tags in `checkpoints_dir`, oldest first."""
    if not os.path.isdir(checkpoints_dir):
        return []
    return sorted(
        t
        for t in os.listdir(checkpoints_dir)
        if CHECKPOINT_TAG.match(t) and os.path.isfile(os.path.join(checkpoints_dir, t, CLIENT_STATE))
    )


def resolve_checkpoint(path: str) -> Tuple[str, str]:
    """A run directory or its checkpoints directory (-> the newest complete checkpoint), or one
    checkpoint -> (checkpoints dir, tag)."""
    path = os.path.abspath(path)
    if os.path.isdir(os.path.join(path, "checkpoints")):
        path = os.path.join(path, "checkpoints")
    if os.path.isfile(os.path.join(path, CLIENT_STATE)):
        return os.path.dirname(path), os.path.basename(path)
    tags = checkpoint_tags(path)
    if tags:
        return path, tags[-1]
    raise FileNotFoundError(
        f"{path} is not a run directory, a checkpoints directory or a checkpoint "
        f"(no complete checkpoint: none holds {CLIENT_STATE})"
    )


def read_client_state(load_dir: str, tag: str) -> Dict:
    with open(os.path.join(load_dir, tag, CLIENT_STATE)) as f:
        return json.load(f)


def load_drafter_for_export(checkpoint: str) -> Tuple[DFlashDrafter, str]:
    """The trained drafter of a checkpoint (fp32 master weights, gathered from every ZeRO partition) and
    the verifier (target) path it was trained against. Frozen target tensors are not loaded: export
    writes trainable weights only."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    load_dir, tag = resolve_checkpoint(checkpoint)
    client = read_client_state(load_dir, tag)
    drafter = DFlashDrafter(DrafterConfig(**client["drafter"]))
    if glob.glob(os.path.join(load_dir, tag, "*optim_states.pt")):
        weights = get_fp32_state_dict_from_zero_checkpoint(load_dir, tag)
    else:  # no ZeRO: the module's own weights
        weights = torch.load(
            os.path.join(load_dir, tag, "mp_rank_00_model_states.pt"), map_location="cpu", weights_only=False
        )["module"]
    expected = dict(drafter.named_parameters())
    missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or extra:
        raise ValueError(
            f"{os.path.join(load_dir, tag)} does not match its drafter config: missing {missing[:5]}, "
            f"unexpected {extra[:5]}"
        )
    with torch.no_grad():
        for name, p in expected.items():
            p.copy_(weights[name].float())
    return drafter, client["verifier"]


def rng_state() -> Dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
