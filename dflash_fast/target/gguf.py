"""A GGUF target as users have it (llama.cpp's single file), turned into the plain Hugging Face checkpoint that every
stage loads: `dflash-fast convert-gguf MODEL.gguf OUT`.

    MODEL.gguf ──transformers (gguf_file=, dequantised)──▶ state dict + config + tokenizer (chat template included)
              ──a plain model of the same class, no quantization_config──▶ OUT/ {config.json, model.safetensors,
                                                                              tokenizer files, gguf_source.json}

Why a conversion rather than `.gguf` accepted by every command: vLLM, SGLang and the trainer's own loaders all read
a Hugging Face directory, and a target must be the same tensors in every engine (the drafter learns its hidden
states). Converting once gives every stage, every engine and the export's model card one directory and one
fingerprint. transformers dequantises GGUF blocks (Q4_*, Q8_0, ...) to floats while loading; OUT holds those values
in fp32 (exact: the same numbers transformers' own GGUF-loaded model computes with) or bf16 (half the size, rounded).
A GGUF-loaded model refuses `save_pretrained` (it is marked quantised), so its state dict goes into a fresh model of
the same class built from the config without the quantisation entry.
"""
import importlib.util
import json
import os
import time

import torch

from dflash_fast.errors import UserError
from dflash_fast.store.format import sha256_file

SOURCE_FILE = "gguf_source.json"  # what OUT was converted from: the file, its sha256, the dtype
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _gguf_path(gguf: str) -> str:
    gguf = os.path.abspath(str(gguf))
    if not os.path.isfile(gguf):
        raise FileNotFoundError(f"{gguf}: no such GGUF file")
    with open(gguf, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{gguf} is not a GGUF file (its first bytes are not b'GGUF'); pass llama.cpp's .gguf "
                             f"file")
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:  # transformers reads GGUF through gguf, and loads a GGUF model only with accelerate installed
        raise UserError(f"reading a GGUF file needs {' and '.join(missing)}: pip install 'dflash-fast[gguf]'")
    return gguf


def load_gguf(gguf: str, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) as transformers loads `gguf` itself: the dequantised model in `dtype`, eval mode, on the
    CPU; the tokenizer and chat template from the file's metadata. The reference every conversion is held to."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path(gguf)
    folder, name = os.path.split(gguf)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype).eval()
    return model, tokenizer


def plain_model(model, dtype: torch.dtype):
    """A model of `model`'s class, without its quantisation marks, holding its tensors in `dtype`."""
    config = model.config
    config_dict = config.to_dict()
    config_dict.pop("quantization_config", None)
    plain_config = type(config).from_dict(config_dict)
    plain_config.dtype = dtype
    plain = type(model)(plain_config)  # on the CPU: non-persistent buffers (RoPE's inv_freq) are built, not loaded
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    tied = set(getattr(plain, "_tied_weights_keys", None) or ()) if config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise ValueError(f"the GGUF model's tensors do not fit a plain {type(model).__name__}: missing "
                         f"{sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    if config.tie_word_embeddings:
        plain.tie_weights()
    return plain.to(dtype).eval()


def gguf_source(gguf: str, dtype: str) -> dict:
    """What gguf_source.json records of a conversion: the file's name and sha256, the dtype written."""
    gguf = _gguf_path(gguf)
    return {"gguf": os.path.basename(gguf), "sha256": sha256_file(gguf), "dtype": dtype}


def convert_gguf(gguf: str, out: str, dtype: str = "fp32") -> dict:
    """Write the plain Hugging Face checkpoint of `gguf` to `out` (see the module docstring); returns what
    gguf_source.json records. An `out` already converted from the same file and dtype is kept as it is."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    source = gguf_source(gguf, dtype)
    marker = os.path.join(out, SOURCE_FILE)
    if os.path.isfile(marker):
        with open(marker) as f:
            done = json.load(f)
        if {k: done.get(k) for k in source} == source:
            return done
        raise ValueError(f"{out} was converted from {done.get('gguf')} ({done.get('dtype')}, sha256 "
                         f"{str(done.get('sha256'))[:12]}...), not {source['gguf']} ({dtype}); pass another --out")
    if os.path.isdir(out) and os.listdir(out):
        raise ValueError(f"{out} exists and is not a conversion of a GGUF file; pass an empty or new --out")
    start = time.perf_counter()
    model, tokenizer = load_gguf(gguf)
    return write_converted(model, tokenizer, out, dict(source, load_seconds=round(time.perf_counter() - start, 1)))


def write_converted(model, tokenizer, out: str, source: dict) -> dict:
    """`load_gguf`'s (model, tokenizer) saved as the plain checkpoint OUT in source["dtype"], gguf_source.json last
    (written into OUT.tmp, renamed when whole: a killed conversion leaves no OUT that looks done)."""
    plain = plain_model(model, DTYPES[source["dtype"]])
    tmp = out.rstrip("/") + ".tmp"
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, SOURCE_FILE), "w") as f:
        json.dump(source, f, indent=1)
    if os.path.isdir(out):
        os.rmdir(out)
    os.replace(tmp, out)
    return source


# ---------------------------------------------------------------- `dflash-fast convert-gguf MODEL.gguf OUT`


def add_arguments(parser) -> None:
    parser.add_argument("gguf", help="llama.cpp's .gguf file of the target")
    parser.add_argument("out", help="the Hugging Face checkpoint directory to write (every --target takes it)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                        help="fp32 (default: exactly the dequantised values) or bf16 (half the size)")


def run(args) -> int:
    source = convert_gguf(args.gguf, args.out, args.dtype)
    print(f"{args.out}: {source['gguf']} dequantised to {source['dtype']} (sha256 {source['sha256'][:12]}...); "
          f"pass it as --target / model.target")
    return 0
