"""Each drafter family's serving home, one module per family named as `DrafterConfig.family` names it (dflash,
dspark, dflash2, lilicorr: the names drafter/families.py registers), each holding its `LAYOUT` (a
`base.FamilyLayout`): how the family is written in each export layout, read by each engine, served and described.
The layouts, the engines' views, the export gate, the model card and `eval --engine vllm` ask these; none of them
names a family.
"""
from importlib import import_module
from typing import Dict, Tuple

from dflash_fast.drafter.families import FAMILIES
from dflash_fast.serve.families.base import FamilyLayout

# family name -> its layout; DFlash (the backbone, drafter/backbone.py) first
LAYOUTS: Dict[str, FamilyLayout] = {
    name: import_module(f"dflash_fast.serve.families.{name}").LAYOUT for name in ("dflash", *FAMILIES)
}
DFLASH = LAYOUTS["dflash"]
# every family's ARCHITECTURE terms for a drafter of none of them (plain DFlash)
OFF = {key: value for layout in LAYOUTS.values() for key, value in layout.off.items()}


def trained_fields(cfg) -> Dict:
    """Every family's ARCHITECTURE terms of the trained drafter `cfg`."""
    return {key: value for layout in LAYOUTS.values() for key, value in layout.fields(cfg).items()}


def speculators_family(config: Dict) -> FamilyLayout:
    """The family a speculators config.json names (speculators_model_type); DFlash for none."""
    return LAYOUTS.get(config.get("speculators_model_type"), DFLASH)


def zlab_family(architectures) -> FamilyLayout:
    """The family whose z-lab architecture `architectures` names; DFlash when none does."""
    return next((layout for layout in LAYOUTS.values() if layout.zlab_architecture in (architectures or [])
                 and layout is not DFLASH), DFLASH)


def family_of(config: Dict, fmt: str) -> FamilyLayout:
    """The family a config.json of layout `fmt` names: speculators_model_type, or the z-lab architecture."""
    return speculators_family(config) if fmt == "speculators" else zlab_family(config["architectures"])


def read_families(view: Tuple[str, str], config: Dict, hf, where: str) -> Dict:
    """Every family's ARCHITECTURE terms as the engine of `view` reads `config`: its own family's `read` over the
    others' `off`."""
    return {**OFF, **family_of(config, view[0]).read(view, config, hf, where)}


def speculators_architectures() -> Dict[str, str]:
    """speculators_model_type -> architectures name, for the families the speculators layout carries."""
    return {name: layout.speculators_architecture for name, layout in LAYOUTS.items()
            if layout.speculators_architecture}


def zlab_architectures() -> Dict[str, str]:
    """family -> z-lab architectures name, for the families the z-lab layout carries."""
    return {name: layout.zlab_architecture for name, layout in LAYOUTS.items() if layout.zlab_architecture}


def hints() -> Dict[str, str]:
    """field -> why an engine serves it differently, for every family's fields."""
    return {key: hint for layout in LAYOUTS.values() for key, hint in layout.hints.items()}


def schema(part: str) -> Dict:
    """The JSON kinds of the config.json keys every family's readers take in `part` ("speculators", "zlab" or
    "dflash_config")."""
    return {key: kind for layout in LAYOUTS.values() for key, kind in layout.schema.get(part, {}).items()}
