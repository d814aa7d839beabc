"""LiLiCorr's terms of the memory model (dflash_fast/train/memory.py `lattice_bytes`, `lattice_transient_bytes`)
against what a CPU step allocates, measured as tests/test_memory_dflash2.py measures DFlash2's (LiveBytes, fp32, the
fused kernels under TRITON_INTERPRET=1)."""
import dataclasses

import pytest
from test_memory import A, B, within
from test_memory import config as plain_config
from test_memory_dflash2 import measure

from dflash_fast.train.memory import lattice_bytes, lattice_transient_bytes

Q = A * B


def lilicorr_config(layers: int = 1, top_k: int = 4, lattice_layers: int = 2, width: int = 0):
    return dataclasses.replace(plain_config(layers), lilicorr_candidate_topk=top_k, lilicorr_num_layers=lattice_layers,
                               lilicorr_hidden_size=width, lilicorr_num_heads=2, lilicorr_factor_dim=16)


@pytest.mark.parametrize("top_k, lattice_layers, width", [(2, 1, 0), (8, 2, 0), (4, 2, 32)])
def test_the_lattices_saved_tensors_match_the_model(top_k, lattice_layers, width):
    """What the lattice keeps for the backward: per lattice row and layer the norms, qkv, the attention and the MLP,
    and the [heads, L, L] probabilities of the biased attention per block."""
    dflash = measure(plain_config(1))[0]
    cfg = lilicorr_config(top_k=top_k, lattice_layers=lattice_layers, width=width)
    within(measure(cfg)[0] - dflash, lattice_bytes(cfg, Q, 4), f"the lattice's saved tensors, K = {top_k}")
    assert lattice_bytes(plain_config(1), Q, 4) == 0 and lattice_transient_bytes(plain_config(1), Q, 4) == 0
