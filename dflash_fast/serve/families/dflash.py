"""DFlash, the backbone (spec.md §3-7), on the serving side: every layout and engine carries it (FamilyLayout's
defaults); SGLang alone builds DFlash2's convolutions into a plain DFlash draft whose dflash_config sets them."""
from typing import Dict, Tuple

from dflash_fast.serve.families.base import VIEW_SGLANG, FamilyLayout
from dflash_fast.serve.families.dflash2 import sglang_convolutions


class DFlash(FamilyLayout):
    def read(self, view: Tuple[str, str], config: Dict, hf, where: str) -> Dict:  # noqa: ARG002 (a hook)
        return sglang_convolutions(config, where) if view == VIEW_SGLANG else {}


LAYOUT = DFlash()
