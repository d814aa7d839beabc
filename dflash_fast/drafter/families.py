"""Every drafter family, the one list of them: DFlash (`backbone.DFlashDrafter` itself) and one module per other
family. Importing this module imports each family's module, which registers its Drafter class with DFlashDrafter,
so that `DFlashDrafter(cfg)` builds the class `cfg.family` names; weights.py and model.py import it.

A family's module holds its Drafter class (a DFlashDrafter subclass: its modules, loss terms and proposal walk) and
`head_shapes(cfg)`, the parameters it adds (name -> shape, from the sizes alone). docs/contributing.md, "A drafter
family", lists the other files a new family touches.
"""
from typing import Dict, Tuple

from dflash_fast.drafter import dflash2, dspark, lilicorr
from dflash_fast.drafter.config import DrafterConfig

# family name (DrafterConfig.family) -> its module; DFlash adds nothing to the backbone
FAMILIES = {"dspark": dspark, "dflash2": dflash2, "lilicorr": lilicorr}


def head_shapes(cfg: DrafterConfig) -> Dict[str, Tuple[int, ...]]:
    """name -> shape of every parameter the family of `cfg` adds to the backbone (empty for DFlash)."""
    module = FAMILIES.get(cfg.family)
    return module.head_shapes(cfg) if module is not None else {}
