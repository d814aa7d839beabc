"""The frozen Hugging Face target loaded, as every stage loads it: the target named (a directory or a hub id,
checked), its model class and attention implementation, its size against the device, its weights materialised,
its lm_head and final norm alone (load_head), and its fingerprint (config_sha256). The tap rule is taps.py's, the
final norm norm.py's.
"""

import importlib.util
import json
import math
import os
import re
import struct
import threading
from typing import List, Optional, Sequence

import torch

from dflash_fast.errors import WEIGHTS_INDEX_SCHEMA, UserError, read_json_object
from dflash_fast.store.format import sha256_file
from dflash_fast.target.norm import detect_norm_kind, final_norm_module

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


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


def auto_class(config):
    """The transformers auto class that loads the language model of `config`'s checkpoint: AutoModelForCausalLM,
    or for a multimodal checkpoint that has no causal-LM class (Qwen3-VL) AutoModelForImageTextToText, whose
    text-only forward runs the language model alone. (Qwen3.5 as shipped has one: Qwen3_5ForCausalLM loads the
    language model of its ForConditionalGeneration checkpoint and leaves the vision tower on disk.)"""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def attention_implementation(device: torch.device, model_class=None) -> str:
    """flash_attention_2 on CUDA when installed and the model takes it, else sdpa, else eager (gpt-oss: transformers
    has no sdpa path for its attention sinks, and flash-attn 2 has no sinks). model_class None: a model whose
    class is unknown before loading (remote code) is assumed to take both."""
    def takes(flag):
        return model_class is None or getattr(model_class, flag, False)

    flash = getattr(model_class, "_compatible_flash_implementations", None)
    if (device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None and takes("_supports_flash_attn")
            and (flash is None or "flash_attention_2" in flash)):
        return "flash_attention_2"
    return "sdpa" if takes("_supports_sdpa") else "eager"


def model_class(auto, config):
    """The class `auto.from_pretrained` builds for `config`; None for remote code (only known once loaded)."""
    try:
        return auto._model_mapping[type(config)]
    except KeyError:
        return None


# Config fields of models whose logits are not lm_head(final_norm(last)): the teacher that training recomputes
# from `last` would silently differ from the model's.
LOGIT_TRANSFORMS = {
    "final_logit_softcapping": "soft-caps its logits with tanh",
    "logit_scale": "scales its logits",
    "logits_scaling": "divides its logits by a constant",
    "output_multiplier_scale": "scales its logits",
}


def check_head(config, target) -> None:
    """Refuse, before loading, a target whose logits are not lm_head(final_norm(last)) (spec.md §2), with the reason;
    the final norm and the weight tying are checked on the loaded model (final_norm_module, detect_norm_kind,
    check_materialised)."""
    text = config.get_text_config()
    for name, what in LOGIT_TRANSFORMS.items():
        value = getattr(text, name, None)
        if value is not None and value != 1:
            raise UserError(
                f"{target}: the model {what} ({name} = {value} in config.json), so its logits are not "
                f"lm_head(final_norm(last)) and a drafter trained on `last` would learn another teacher; unsupported"
            )


def device_memory(device: torch.device) -> int:
    """Bytes of memory on `device`: the GPU's total, or the host's physical memory for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _safetensors_files(target) -> List[str]:
    """The checkpoint's safetensors files available on this machine (local directory or hub cache); [] if unknown."""
    from huggingface_hub import try_to_load_from_cache

    def find(name):
        if os.path.isdir(target):
            path = os.path.join(target, name)
            return path if os.path.isfile(path) else None
        path = try_to_load_from_cache(target, name)  # never downloads
        return path if isinstance(path, str) else None

    index = find("model.safetensors.index.json")
    if index is not None:
        weight_map = read_json_object(index, "a safetensors index", WEIGHTS_INDEX_SCHEMA)["weight_map"]
        shards = sorted(set(weight_map.values()))
        paths = [find(shard) for shard in shards]
        return paths if all(paths) else []
    single = find("model.safetensors")
    return [single] if single else []


def weight_bytes(target, compute_dtype: torch.dtype, skipped: Sequence[str] = ()) -> Optional[int]:
    """Bytes the checkpoint's tensors take once loaded: floating-point tensors in `compute_dtype`, the others
    (quantised blocks, integer buffers) as stored; tensors whose names match a regex of `skipped` (what the model
    class leaves on disk, e.g. the vision tower of Qwen3.5) do not count. Read from the safetensors headers alone
    (no tensor data, no unpickling); None when the checkpoint has no safetensors on this machine."""
    files = _safetensors_files(target)
    if not files:
        return None
    itemsize = torch.empty((), dtype=compute_dtype).element_size()
    total = 0
    for path in files:
        with open(path, "rb") as f:
            head = f.read(8)
            try:
                header = json.loads(f.read(struct.unpack("<Q", head)[0]) if len(head) == 8 else b"")
            except ValueError:  # JSONDecodeError, UnicodeDecodeError
                header = None
        if not isinstance(header, dict):
            raise ValueError(f"{path} is not a safetensors file (its header does not parse): the checkpoint is damaged")
        for name, info in header.items():
            if name == "__metadata__" or any(re.search(p, name) for p in skipped):
                continue
            numel = math.prod(info["shape"])
            stored = info["data_offsets"][1] - info["data_offsets"][0]
            total += numel * itemsize if info["dtype"] in ("F64", "F32", "F16", "BF16") else stored
    return total


def check_fits(target, device: torch.device, compute_dtype: torch.dtype, skipped: Sequence[str] = ()) -> None:
    """Refuse, before loading, a target whose weights (weight_bytes) exceed the memory of the one device the HF
    path loads it onto, naming both sizes."""
    needed = weight_bytes(target, compute_dtype, skipped)
    have = device_memory(device)
    if needed is not None and needed > have:
        dtype = str(compute_dtype).replace("torch.", "")
        raise UserError(
            f"target {target}: its weights take {needed:,} bytes ({needed / 2**30:.1f} GiB) in {dtype} but {device} "
            f"has {have:,} bytes ({have / 2**30:.1f} GiB); the Hugging Face path loads the whole target on one "
            f"device. Extract a target this size with the engine: `dflash-fast extract --engine vllm "
            f"--tensor-parallel-size N` (docs/engine-target.md); see docs/targets.md"
        )


# transformers' from_pretrained swaps PreTrainedModel.tie_weights for a no-op while it loads and
# puts it back afterwards; two loads in parallel threads can restore the no-op for good, after
# which every tied lm_head of the process stays on the meta device. Loads are serialised.
_LOAD_LOCK = threading.Lock()


def load_target(target, device, compute_dtype, trust_remote_code=False):
    """The frozen target's language model on `device` in `compute_dtype`, eval mode; refused before loading when
    its logits are not lm_head(final_norm(last)) or its weights exceed the device, and after loading when its
    final norm or weight tying is not what every stage assumes."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target, trust_remote_code=trust_remote_code)
    check_head(config, target)
    auto = auto_class(config)
    cls = model_class(auto, config)
    check_fits(target, device, compute_dtype, getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or ())
    text = config.get_text_config()
    if getattr(text, "output_router_logits", False):
        # A MoE config saved for training: router logits of every layer and an aux loss, for nothing here.
        text.output_router_logits = False
    kwargs = {}
    if device.type == "cuda" and importlib.util.find_spec("accelerate") is not None:
        # Loads straight onto the GPU; without accelerate the model passes through host memory.
        kwargs["device_map"] = {"": device}
    with _LOAD_LOCK:
        model, info = auto.from_pretrained(
            target,
            config=config,
            dtype=compute_dtype,
            attn_implementation=attention_implementation(device, cls),
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
            **kwargs,
        )
        model.tie_weights()  # a tied lm_head left unmaterialised by a meta-device load is re-tied, not copied from meta
    check_materialised(model, target, info.get("missing_keys", ()))
    detect_norm_kind(final_norm_module(model)[0])
    return model.to(device).eval()


def check_materialised(model, target, missing=()) -> None:
    """Refuse a model with weights the checkpoint does not hold (`missing`: from_pretrained initialised them at
    random, e.g. an lm_head of a config that does not tie it to the embeddings) or left on the meta device (never
    loaded), or an lm_head the config ties to the embeddings that is not tied: each would give teacher logits
    from random numbers."""
    tied = {name for name, t in model.named_parameters(remove_duplicate=False)} - {
        name for name, _ in model.named_parameters()}
    missing = sorted(set(missing) - tied)
    if missing:
        raise UserError(
            f"{target}: the checkpoint holds no {', '.join(missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            + " (transformers would initialise them at random); a whole causal LM checkpoint is needed"
        )
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


def load_head(target, device, compute_dtype, trust_remote_code=False):
    """The target's final norm and lm_head alone, on `device` in `compute_dtype`, for a stage whose target runs
    elsewhere (an engine): the model is built on the meta device, only these two modules are materialised and
    filled from the checkpoint's safetensors (a tied lm_head from the embeddings). Returns the model skeleton,
    the norm, its dotted name, and lm_head; the norm's kind is measured as load_target measures it."""
    from safetensors import safe_open
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target, trust_remote_code=trust_remote_code)
    check_head(config, target)
    with torch.device("meta"):
        model = auto_class(config).from_config(config, dtype=compute_dtype, trust_remote_code=trust_remote_code)
    norm, norm_name = final_norm_module(model)
    head = model.get_output_embeddings()
    names = {id(m): name for name, m in model.named_modules()}
    keys = {f"{norm_name}.weight": norm}
    tied = getattr(config.get_text_config(), "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings",
                                                                                       False)
    keys[f"{names[id(model.get_input_embeddings() if tied else head)]}.weight"] = head
    where = {}
    for path in _safetensors_files(target):
        with safe_open(path, "pt") as f:
            where.update((key, path) for key in f.keys() if key in keys)
    missing = sorted(set(keys) - set(where))
    if missing:
        raise UserError(f"{target}: its safetensors hold no {', '.join(missing)} (the final norm and lm_head the "
                        f"teacher is computed with); a whole causal LM checkpoint in safetensors is needed")
    for key, module in keys.items():
        module.to_empty(device=device)
        with safe_open(where[key], "pt") as f:
            weight = f.get_tensor(key)
        if weight.shape != module.weight.shape:
            raise UserError(f"{target}: {key} has shape {list(weight.shape)}, its config says "
                            f"{list(module.weight.shape)}: config.json and the weights disagree")
        with torch.no_grad():
            module.weight.copy_(weight.to(module.weight.dtype))
    detect_norm_kind(norm)
    return model, norm.eval(), norm_name, head.eval()
