"""The frozen Hugging Face target, as every stage sees it: loading, the tap rule, the final norm, its fingerprint.

Extraction, the online trainer, regeneration and evaluation all load and tap the target through this module,
so there is one definition of what "layer id l" and "`last`" mean (SPEC §1-2):

    layer id l (0 <= l < L)  ->  HF hidden_states[l + 1], except id L-1  ->  `last` (the final norm's input)
    `last`                   ->  the residual entering the final norm, captured by a hook (never hidden_states[L],
                                 which most models return AFTER the norm)
"""
import copy
import importlib.util
import os
import re
import threading
from typing import List, Optional, Tuple

import torch

from dflash_fast.eager import rms_norm
from dflash_fast.errors import UserError
from dflash_fast.store import NORM_KINDS, final_norm_weight, sha256_file

# Conversation roles every stage accepts (ShareGPT's names are aliases).
ROLE_ALIASES = {"human": "user", "gpt": "assistant", "model": "assistant"}
KNOWN_ROLES = ("system", "user", "assistant", "tool")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def text_problem(text: str) -> Optional[str]:
    """Why `text` cannot reach a tokenizer, or None. JSON can spell strings that are not Unicode text: a lone
    surrogate such as "\\ud800" parses, and the tokenizer then fails with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"holds a lone surrogate U+{ord(text[e.start]):04X} at character {e.start}, which is not Unicode text"
    return None


class TextError(ValueError):
    """One record's text that the target's chat template or tokenizer cannot take; callers add where it is."""


def on_text(what: str, fn, *args, **kwargs):
    """fn(*args, **kwargs): the target's chat template or tokenizer run on one record's text. Whatever that
    third-party code raises on it is this record's failure: a TextError naming `what` and the cause."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # any type: see the docstring
        raise TextError(f"{what} failed on it ({type(e).__name__}: {e})") from None


def hub_offline() -> bool:
    """HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE, read as huggingface_hub reads them."""
    return any(os.environ.get(k, "").upper() in ("1", "ON", "YES", "TRUE") for k in ("HF_HUB_OFFLINE",
                                                                                     "TRANSFORMERS_OFFLINE"))


def check_target(target: str) -> str:
    """Refuse a target that cannot load, before transformers tries a hub: a local directory must hold a
    config.json; a name that is not a local directory must look like a hub id ("name" or "org/name" whose "org"
    is not a local directory), and with offline mode set it must already be in the hub cache. Returns `target`."""
    target = str(target)
    if os.path.isdir(target):
        if not os.path.isfile(os.path.join(target, "config.json")):
            raise FileNotFoundError(f"target {target} has no config.json: it is not a Hugging Face model directory")
        return target
    if os.path.exists(target):
        raise NotADirectoryError(f"target {target} is a file: pass the model's directory")
    parent = os.path.dirname(target)
    if not _HUB_ID.match(target) or ".." in target or "--" in target or (parent and os.path.isdir(parent)):
        raise FileNotFoundError(f"target {target} does not exist (no such directory)")
    if hub_offline():
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(target, "config.json"), str):
            raise FileNotFoundError(
                f"target {target} does not exist: no such local directory, and offline mode (HF_HUB_OFFLINE) allows "
                f"no download of a hub model that is not in the local cache"
            )
    return target

def final_norm_module(model):
    """The final norm of a causal LM (`model.model.norm`) and its dotted name."""
    for name in ("model.norm", "model.language_model.norm"):
        module = model
        for part in name.split("."):
            module = getattr(module, part, None)
        if isinstance(module, torch.nn.Module):
            return module, name
    raise ValueError(f"{type(model).__name__}: cannot find the final norm (looked for model.norm); unsupported target")


def detect_norm_kind(norm) -> Tuple[str, float]:
    """Which RMSNorm formula the final norm computes: 'rmsnorm' (x*w) or 'rmsnorm_zero_centred' (x*(1+w)).

    Probed on a copy with random weights: class names lie, the arithmetic does not.
    """
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    weight = getattr(norm, "weight", None)
    if eps is None or weight is None or weight.dim() != 1:
        raise ValueError(f"final norm {type(norm).__name__} is not an RMSNorm with (weight, eps); unsupported target")
    probe = copy.deepcopy(norm).to(device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        probe.weight.copy_(torch.randn(weight.shape, generator=gen))
        x = torch.randn(4, weight.shape[0], generator=gen)
        y = probe(x)
        for kind in NORM_KINDS:
            if torch.allclose(rms_norm(x, final_norm_weight(probe.weight, kind), eps), y, rtol=1e-5, atol=1e-6):
                return kind, float(eps)
    raise ValueError(f"final norm {type(norm).__name__} computes neither x*w nor x*(1+w) RMSNorm; unsupported target")


def attention_implementation(device: torch.device) -> str:
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


# transformers' from_pretrained swaps PreTrainedModel.tie_weights for a no-op while it loads and
# puts it back afterwards; two loads in parallel threads can restore the no-op for good, after
# which every tied lm_head of the process stays on the meta device. Loads are serialised.
_LOAD_LOCK = threading.Lock()


def load_target(target, device, compute_dtype, trust_remote_code=False):
    from transformers import AutoModelForCausalLM

    kwargs = {}
    if device.type == "cuda" and importlib.util.find_spec("accelerate") is not None:
        # Loads straight onto the GPU; without accelerate the model passes through host memory.
        kwargs["device_map"] = {"": device}
    with _LOAD_LOCK:
        model = AutoModelForCausalLM.from_pretrained(
            target,
            dtype=compute_dtype,
            attn_implementation=attention_implementation(device),
            trust_remote_code=trust_remote_code,
            **kwargs,
        )
        model.tie_weights()  # a tied lm_head left unmaterialised by a meta-device load is re-tied, not copied from meta
    check_materialised(model, target)
    return model.to(device).eval()


def check_materialised(model, target) -> None:
    """Refuse a model with weights left on the meta device (never loaded), or an lm_head the config
    ties to the embeddings that is not tied: both would give teacher logits from random numbers."""
    on_meta = [name for name, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if on_meta:
        raise UserError(
            f"{target}: weights left unloaded (on the meta device) after from_pretrained: {', '.join(on_meta[:5])}"
            + (f" and {len(on_meta) - 5} more" if len(on_meta) > 5 else "")
        )
    config = getattr(model.config, "get_text_config", lambda: model.config)()
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if getattr(config, "tie_word_embeddings", False) and head is not None and head.weight is not embed.weight:
        if not torch.equal(head.weight.detach().cpu(), embed.weight.detach().cpu()):
            raise UserError(f"{target}: the config ties lm_head to embed_tokens but the loaded lm_head differs")


def config_sha256(target) -> str:
    """sha256 of the target's config.json (local directory or hub cache)."""
    path = os.path.join(target, "config.json")
    if not os.path.isfile(path):
        from transformers.utils import cached_file

        path = cached_file(target, "config.json")
    return sha256_file(path)


def tapped_layers(hidden_states, last, layer_ids) -> List[torch.Tensor]:
    """SPEC §1: layer id l is HF hidden_states[l + 1], except that hidden_states[L] is the last layer
    AFTER the final norm, so id L-1 is taken before it: `last`, the final norm's input."""
    num_layers = len(hidden_states) - 1
    return [hidden_states[i + 1] if i < num_layers - 1 else last for i in layer_ids]


