"""What a drafter family is to the serving side (`FamilyLayout`), and the error every export check raises.

A family's serving home (serve/families/<family>.py, named as `DrafterConfig.family` names it) subclasses
FamilyLayout and overrides what it adds to the DFlash backbone's export: the architecture names the layouts give it,
the config.json fields that carry its options in each layout, how each engine's view reads them back (in the terms of
`architecture.ARCHITECTURE`), which engines serve it, what vLLM needs to serve it, the refusals the engines' readings
do not already give, and its lines of the model card. FamilyLayout itself is DFlash: the backbone adds nothing.

    views (serve/views.py)        the engines' views of an export: VIEW_* below; each family's fields come from
                                  its `read` for the view, every other family's from its `off`
    layouts (serve/layouts.py)    `speculators_fields`, `zlab_fields`, the architecture names and `schema`
    engines (serve/engines.py)    `engines`, `refusals`
    model_card, evaluate/vllm.py  `title`, `card_row`, `vllm_method`, `vllm_v2`, `vllm_loaded`
    serve/llama_cpp.py            `gguf_tensors`, `gguf_read`, `gguf_problems`
"""
from typing import Dict, List, Optional, Tuple

from dflash_fast.drafter.config import DrafterConfig

# An engine's view of a layout (serve/views.py VIEWS): (format, engine).
VIEW_SPECULATORS = ("speculators", "speculators")
VIEW_VLLM_SPECULATORS = ("speculators", "vllm")
VIEW_SGLANG = ("zlab", "sglang")
VIEW_VLLM_ZLAB = ("zlab", "vllm")


class ExportError(ValueError):
    """An export cannot be written, or an export on disk cannot be read, as a serving engine would serve it; the
    message names the field, the engine and the fix."""


class FamilyLayout:
    """DFlash, the backbone: every hook adds nothing. A family overrides the attributes and hooks it changes."""

    name = "dflash"  # DrafterConfig.family; the speculators layout's speculators_model_type
    short = "DFlash"  # in messages ("this DFlash2 drafter")
    title = "DFlash"  # the model card's family line
    speculators_architecture: Optional[str] = "DFlashDraftModel"  # None: the speculators layout cannot carry it
    zlab_architecture: Optional[str] = "DFlashDraftModel"  # None: the zlab layout cannot carry it
    engines: Optional[Tuple[str, ...]] = None  # the engines that read its export; None: every engine of the layout
    vllm_method = "dflash"  # vLLM's speculative_config method
    vllm_v2 = False  # vLLM serves it with its V2 model runner only
    off: Dict = {}  # its ARCHITECTURE terms for a drafter of another family
    # the JSON kinds of the config.json keys its readers take: "speculators" / "zlab" (top level), "dflash_config"
    schema: Dict[str, Dict] = {}
    hints: Dict[str, str] = {}  # field -> why an engine serves it differently, and the fix (engines.HINTS)
    # its tensors' GGUF names as llama.cpp's converter writes them (gguf-py tensor_mapping.py, MODEL_ARCH.DFLASH):
    # our name -> the GGUF's, a per-layer one as "layers.{i}.<ours>" -> "blk.{i}.<theirs>" (serve/llama_cpp.py)
    gguf_tensors: Dict[str, str] = {}

    def fields(self, cfg: DrafterConfig) -> Dict:  # noqa: ARG002 (a hook)
        """Its ARCHITECTURE terms of the trained drafter `cfg` (the `off` values when `cfg` is of another family)."""
        return {}

    def speculators_fields(self, cfg: DrafterConfig) -> Dict:  # noqa: ARG002 (a hook)
        """The top-level config.json fields of the speculators layout that carry its options."""
        return {}

    def zlab_fields(self, cfg: DrafterConfig) -> Tuple[Dict, Dict]:  # noqa: ARG002 (a hook)
        """(top level, dflash_config) fields of the z-lab layout that carry its options."""
        return {}, {}

    def read(self, view: Tuple[str, str], config: Dict, hf, where: str) -> Dict:  # noqa: ARG002 (a hook)
        """Its ARCHITECTURE terms as the engine of `view` reads them from `config` (transformers' config `hf`),
        raising ExportError naming the field where that engine would refuse it; what it leaves out is `off`."""
        return {}

    def gguf_read(self, fields: Dict) -> Dict:  # noqa: ARG002 (a hook)
        """Its ARCHITECTURE terms as llama.cpp builds them from a DFlash GGUF (`fields`: its metadata, its tensor
        names under "__tensors__" and their GGUF shapes, fastest dimension first, under "__shapes__"); what it
        leaves out is `off` (serve/llama_cpp.py gguf_architecture)."""
        return {}

    def gguf_problems(self, fields: Dict) -> List[str]:  # noqa: ARG002 (a hook)
        """What llama.cpp refuses or aborts on in a DFlash GGUF (`fields` as for `gguf_read`) for this family's
        part, by field: what its reading alone cannot show (serve/llama_cpp.py gguf_problems)."""
        return []

    def vllm_loaded(self, hf) -> Dict:  # noqa: ARG002 (a hook)
        """Its ARCHITECTURE terms as the config vLLM itself loaded (`hf`) holds them (evaluate/vllm.py)."""
        return {}

    def refusals(self, cfg: DrafterConfig, fmt: str) -> List[str]:  # noqa: ARG002 (a hook)
        """Why the engines of `fmt` cannot serve `cfg` as it trained, beyond what their views read differently."""
        return []

    def card_row(self, cfg: DrafterConfig) -> Optional[Tuple[str, str]]:  # noqa: ARG002 (a hook)
        """Its row of the model card's drafter table, or None."""
        return None
