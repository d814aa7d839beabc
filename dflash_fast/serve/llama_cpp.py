"""llama.cpp serving a DFlash drafter on the CPU (docs/llama-cpp.md): its tools built from the llama.cpp source that
PyPI's llama-cpp-python sdist vendors (scripts/build_llama_cpp.sh), a drafter converted to GGUF by that tree's own
converter (convert_hf_to_gguf.py, from our zlab layout, or the speculators one for DSpark), and the gate: the GGUF
read back as llama.cpp reads it.

llama.cpp (the tree vendored by llama-cpp-python 0.3.36, commit 0c1e570 of 2026-10-01) reads a DFlash GGUF so
(paths are the vendored tree's):

    conversion/qwen.py DFlashModel       zlab config.json -> GGUF: `target_layers` = dflash_config.target_layer_ids + 1,
                                         `tokenizer.ggml.mask_token_id`, `dflash.block_size` (16 when absent),
                                         `dflash.attention.causal` only when the config says is_causal / causal,
                                         a sliding window with its per-layer pattern; vocabulary from the target
    common/speculative.cpp               draft-dflash: block_size from `dflash.block_size`, one in-block rule for
      common_speculative_impl_draft_dflash   every layer (`dflash.attention.causal`, default false: bidirectional),
                                         the mask token of the vocabulary; taps llama_set_embeddings_layer_inp(id)
    src/llama-graph.cpp set_outputs      the input of target layer `id` (src/models/qwen3.cpp, llama.cpp:
                                         t_layer_inp[il] = inpL for il < n_layer); id = n_layer is set by a few
                                         architectures only (deepseek4, mimo2, nemotron-h): for Qwen3 and Llama
                                         it aborts ("layer input tensor is null")
    src/models/dflash.cpp                sliding layers: LLAMA_SWA_TYPE_STANDARD, each query's window ends at its
                                         own position (our `window_from=query`)

So a tap `id + 1` is HF's hidden_states[id + 1], our layer id `id` (spec.md §1), for every layer but the last.
"""
import json
import os
import runpy
import shutil
import struct
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

from dflash_fast.serve.architecture import ARCHITECTURE, architecture
from dflash_fast.serve.engines import mismatches
from dflash_fast.serve.families import LAYOUTS, OFF
from dflash_fast.serve.layouts import ExportError

LLAMA_CPP_PYTHON = "0.3.36"  # the llama-cpp-python sdist whose vendor/llama.cpp is built and read
CACHE_ENV = "DFLASH_LLAMA_CPP_CACHE"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD_SCRIPT = os.path.join(REPO, "scripts", "build_llama_cpp.sh")
# Target architectures whose llama.cpp graph sets t_layer_inp[n_layer] (the residual entering the final norm):
# src/models/deepseek4.cpp, mimo2.cpp, nemotron-h.cpp. Every other tapped architecture (qwen3, llama, ...) sets
# t_layer_inp[il] for il < n_layer only.
TAPS_FINAL_INPUT = ("deepseek4", "mimo2", "nemotron_h")
# Hugging Face's Qwen2 pre-tokenizer regex (tokenizer.json), which llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2 implements
# (src/llama-vocab.cpp, "original regex from tokenizer.json"). The embedded target's tokenizer uses it; the
# converter only recognises pre-tokenizers by a hash of a known vocabulary's tokens (conversion/base.py
# get_vocab_base_pre).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")


def cache_root(version: str = LLAMA_CPP_PYTHON) -> str:
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "dflash-fast", "llama.cpp")
    return os.path.join(root, version)


def source_dir(version: str = LLAMA_CPP_PYTHON) -> str:
    """The vendored llama.cpp tree the build script unpacked."""
    return os.path.join(cache_root(version), "src", f"llama_cpp_python-{version}", "vendor", "llama.cpp")


def build_tools(tools: Sequence[str] = (), version: str = LLAMA_CPP_PYTHON) -> str:
    """The directory of the built tools (`tools`, else the script's three): scripts/build_llama_cpp.sh, which reuses
    the cached ones."""
    env = dict(os.environ, LLAMA_CPP_PYTHON_VERSION=version)
    done = subprocess.run(["bash", BUILD_SCRIPT, *tools], env=env, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise ExportError(f"scripts/build_llama_cpp.sh failed (exit {done.returncode}); its error is above")
    return done.stdout.strip().splitlines()[-1]


def pre_tokenizer(model_dir: str) -> Optional[str]:
    """llama.cpp's name for the pre-tokenizer of model_dir/tokenizer.json when it is one llama.cpp implements by
    its regex (Qwen2's split, then byte-level without its own regex), else None."""
    try:
        with open(os.path.join(model_dir, "tokenizer.json"), encoding="utf-8") as f:
            pre = json.load(f).get("pre_tokenizer") or {}
    except (OSError, ValueError):
        return None
    steps = pre.get("pretokenizers", [])
    if [s.get("type") for s in steps] != ["Split", "ByteLevel"]:
        return None
    split, byte_level = steps
    if split.get("pattern", {}).get("Regex") == QWEN2_SPLIT and split.get("behavior") == "Isolated" \
            and not split.get("invert") and byte_level.get("use_regex") is False:
        return "qwen2"
    return None


def convert(model_dir: str, out_path: str, target_dir: Optional[str] = None, outtype: str = "f32",
            version: str = LLAMA_CPP_PYTHON) -> str:
    """model_dir (a Hugging Face model, or a zlab export with target_dir its target) written to out_path as GGUF by
    the vendored convert_hf_to_gguf.py, run in a child process. Returns out_path."""
    src = source_dir(version)
    if not os.path.isfile(os.path.join(src, "convert_hf_to_gguf.py")):
        raise ExportError(f"{src} has no convert_hf_to_gguf.py: run scripts/build_llama_cpp.sh first (it unpacks "
                          f"llama-cpp-python {version}'s vendored llama.cpp)")
    argv = [model_dir, "--outfile", out_path, "--outtype", outtype]
    if target_dir is not None:
        argv += ["--target-model-dir", target_dir]
    done = subprocess.run([sys.executable, "-m", __name__, src, *argv], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0 or not os.path.isfile(out_path):
        tail = "\n".join(done.stdout.strip().splitlines()[-15:])
        raise ExportError(f"llama.cpp's convert_hf_to_gguf.py could not convert {model_dir}:\n{tail}")
    return out_path


def _run_converter(src: str, argv: List[str]) -> None:
    """convert_hf_to_gguf.py as `python convert_hf_to_gguf.py ARGV`, except that a BPE pre-tokenizer its hash table
    does not know is named by `pre_tokenizer` when llama.cpp implements its regex (the embedded target's)."""
    sys.path[:0] = [src, os.path.join(src, "gguf-py")]
    from conversion import base  # the vendored tree's converter package

    hashed = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):
        try:
            return hashed(self, tokenizer)
        except NotImplementedError:
            name = pre_tokenizer(str(self.dir_model))
            if name is None:
                raise
            print(f"dflash-fast: {self.dir_model}/tokenizer.json splits with {name}'s regex: "
                  f"tokenizer.ggml.pre = {name!r}", file=sys.stderr)
            return name

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [os.path.join(src, "convert_hf_to_gguf.py"), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")


# ---------------------------------------------------------------- the gate: a GGUF as llama.cpp reads it


def read_gguf_fields(path: str) -> Dict:
    """{key: value} of a GGUF's metadata (the `gguf` package, the reader of llama.cpp's own gguf-py), and the tensor
    names under "__tensors__"."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as e:
        raise ExportError(f"{path} is not a readable GGUF file: {e}") from None
    fields = {name: field.contents() for name, field in reader.fields.items()}
    fields["__tensors__"] = [t.name for t in reader.tensors]
    fields["__shapes__"] = {t.name: [int(n) for n in t.shape] for t in reader.tensors}  # ne: fastest first
    return fields


def gguf_architecture(fields: Dict) -> Dict:
    """The drafter llama.cpp builds from a DFlash GGUF's metadata, in the terms of engines.ARCHITECTURE. `layer_ids`
    are the GGUF's target_layers - 1 (ours: llama.cpp taps the input of layer target_layers[k])."""
    where = "llama.cpp (src/models/dflash.cpp load_arch_hparams)"
    if fields.get("general.architecture") != "dflash":
        raise ExportError(f"the GGUF's general.architecture is {fields.get('general.architecture')!r}, not "
                          f"'dflash': llama.cpp would not load it as a DFlash drafter")

    def need(key):
        if key not in fields:
            raise ExportError(f"the GGUF has no {key!r} ({where} needs it)")
        return fields[key]

    heads = need("dflash.attention.head_count")
    layers = need("dflash.block_count")
    head_dim = fields.get("dflash.attention.key_length", need("dflash.embedding_length") // heads)
    window = fields.get("dflash.attention.sliding_window", 0)
    pattern = fields.get("dflash.attention.sliding_window_pattern", [False] * layers) if window else [False] * layers
    causal = fields.get("dflash.attention.causal", False)  # common/speculative.cpp: one rule, default false
    rope = {"rope_theta": float(need("dflash.rope.freq_base")), "rope_type": "default"}
    if fields.get("dflash.rope.scaling.type", "none") not in ("none",):
        rope["rope_type"] = fields["dflash.rope.scaling.type"]
    if fields.get("dflash.rope.dimension_count", head_dim) != head_dim:
        rope["partial_rotary_factor"] = fields["dflash.rope.dimension_count"] / head_dim
    return {
        "hidden_size": need("dflash.embedding_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": fields.get("dflash.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "intermediate_size": need("dflash.feed_forward_length"),
        "vocab_size": len(need("tokenizer.ggml.tokens")),
        "target_hidden_size": need("dflash.embedding_length"),  # fc is [K * n_embd, n_embd]: the target's width
        "layer_ids": [int(t) - 1 for t in need("target_layers")] if "target_layers" in fields
        else [int(t) - 1 for t in need("dflash.target_layers")],
        "mask_token_id": need("tokenizer.ggml.mask_token_id"),
        "block_size": fields.get("dflash.block_size", 16),  # common/speculative.cpp: 16 when absent
        "rms_norm_eps": float(need("dflash.attention.layer_norm_rms_epsilon")),
        "rope_parameters": rope,
        "max_position_embeddings": need("dflash.context_length"),
        "num_layers": layers,
        "layer_windows": [window if w else None for w in pattern],
        "layer_causal": [bool(causal)] * layers,
        "window_from": "query" if any(pattern) else None,  # LLAMA_SWA_TYPE_STANDARD: each query's own window
        **OFF,  # what src/models/dflash.cpp builds of no family (no LiLiCorr lattice): each family's `off`
        **{k: v for layout in LAYOUTS.values() for k, v in layout.gguf_read(fields).items()},
    }


def draft_settings(fields: Dict) -> Tuple[str, int]:
    """(--spec-type, --spec-draft-n-max) that serve a drafter GGUF as it was trained: draft-dspark for a Markov head,
    else draft-dflash (DFlash2 too: its selector switches itself on); every slot the block drafts, which is
    llama.cpp's own cap (common/speculative.cpp:1016): block_size with DSpark's sample_from_anchor (the block is
    [id_last, mask * (B - 1)] and all B slots are drafts), else block_size - 1."""
    arch = gguf_architecture(fields)
    dspark = arch["markov_rank"] > 0
    n_max = arch["block_size"] if dspark and arch["sample_from_anchor"] else arch["block_size"] - 1
    return ("draft-dspark" if dspark else "draft-dflash"), n_max


# Our tensor names -> the converter's (gguf-py tensor_mapping.py, MODEL_ARCH.DFLASH); per layer under blk.{i}.
GGUF_NAMES = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight",
              "norm.weight": "output_norm.weight"}
GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(name: str) -> Optional[str]:
    """The GGUF tensor name of one of our drafter tensors (the backbone's, or a family's `gguf_tensors`), None for
    those without an entry."""
    if name in GGUF_NAMES:
        return GGUF_NAMES[name]
    parts = name.split(".", 2)
    if parts[0] == "layers" and len(parts) == 3 and parts[2] in GGUF_LAYER_NAMES:
        return f"blk.{parts[1]}.{GGUF_LAYER_NAMES[parts[2]]}"
    family = {ours: gguf for layout in LAYOUTS.values() for ours, gguf in layout.gguf_tensors.items()}
    if name in family:
        return family[name]
    if parts[0] == "layers" and len(parts) == 3 and f"layers.{{i}}.{parts[2]}" in family:
        return family[f"layers.{{i}}.{parts[2]}"].format(i=parts[1])
    return None


def tensor_problems(path: str, tensors: Dict) -> List[str]:
    """One line per drafter tensor the GGUF does not hold as given (`tensors`: our names -> the values the export
    wrote, rounded to its dtype), and when the GGUF holds another number of tensors."""
    import gguf
    import numpy as np
    import torch

    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    lines = [] if len(stored) == len(tensors) else [
        f"the GGUF holds {len(stored)} tensors, the drafter {len(tensors)}: {sorted(stored)[:8]}"]
    for name, value in tensors.items():
        target = gguf_name(name)
        if target is None:
            continue
        if target not in stored:
            lines.append(f"{name}: no tensor {target!r} in the GGUF")
            continue
        t = stored[target]
        data = np.asarray(t.data)
        if t.tensor_type == gguf.GGMLQuantizationType.BF16:
            data = (np.ascontiguousarray(data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)  # raw bytes
        elif t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            lines.append(f"{name}: stored as {t.tensor_type.name}; the export writes f32, bf16 or f16")
            continue
        got = torch.from_numpy(data.astype(np.float32)).reshape(value.shape)
        if not torch.equal(got, value.float()):
            lines.append(f"{name}: {target} differs from the trained tensor (max |diff| "
                         f"{(got - value.float()).abs().max().item():.3g})")
    return lines


def target_tap_problems(layer_ids: List[int], target_arch: str, target_num_layers: int) -> List[str]:
    """One line when a tap reads past what llama.cpp's target graph exposes: GGUF id L (our layer L-1) is only set
    by TAPS_FINAL_INPUT architectures."""
    last = target_num_layers - 1
    if last not in layer_ids or target_arch in TAPS_FINAL_INPUT:
        return []
    return [f"layer_ids: layer id {last} (the target's last layer, L = {target_num_layers}) is GGUF target_layers "
            f"{last + 1}, the input of a layer {last + 1} llama.cpp's {target_arch} graph does not have (src/models/"
            f"{target_arch}.cpp sets t_layer_inp only below n_layer; llama-graph.cpp aborts 'layer input tensor is "
            f"null'): train without layer id {last}"]


def gguf_problems(fields: Dict, trained: Dict, target_arch: str, target_num_layers: int) -> List[str]:
    """Every field llama.cpp would serve differently from the trained architecture, named (engines.mismatches), and
    taps its target graph does not expose. The sliding window's end (SERVING_RULES' window_from) is not refused:
    llama.cpp ends it at each query, as SGLang and vLLM do, and the zlab export it converts already warns of a
    drafter trained with the anchor's."""
    served = gguf_architecture(fields)
    trained = dict(trained, rms_norm_eps=_f32(trained["rms_norm_eps"]),  # GGUF stores these as float32
                   rope_parameters={k: _f32(v) if isinstance(v, float) else v
                                    for k, v in trained["rope_parameters"].items()})
    return (mismatches(trained, {"llama.cpp": served})
            + [line for layout in LAYOUTS.values() for line in layout.gguf_problems(fields)]
            + target_tap_problems(served["layer_ids"], target_arch, target_num_layers))


def _f32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def check_gguf(path: str, trained: Dict, target_gguf_or_config: Dict) -> None:
    """Refuse the drafter GGUF at `path` when llama.cpp would serve it other than `trained` (an ARCHITECTURE dict)
    next to the target described by {"architecture": llama.cpp arch name, "num_layers": L}."""
    problems = gguf_problems(read_gguf_fields(path), trained, target_gguf_or_config["architecture"],
                             target_gguf_or_config["num_layers"])
    if problems:
        raise ExportError(f"{path}: llama.cpp would serve this drafter differently from how it trained: "
                          + "; ".join(problems))


def target_description(target_dir: str) -> Dict:
    """{"architecture", "num_layers"} of a Hugging Face target as llama.cpp names them (model_type, lowercase)."""
    with open(os.path.join(target_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config = config.get("text_config", config)
    return {"architecture": config["model_type"].replace("-", "_"), "num_layers": config["num_hidden_layers"]}


GGUF_TYPES = {"bf16": "bf16", "fp16": "f16", "fp32": "f32"}  # our --dtype -> the converter's --outtype


def local_target(verifier: str) -> str:
    """A directory holding the target's config.json and tokenizer (what the converter reads): `verifier` itself, or
    those files of a Hugging Face hub id (from the local cache when offline)."""
    if os.path.isdir(verifier):
        return verifier
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(verifier, allow_patterns=["*.json", "*.txt", "*.model", "*.jinja", "tokenizer*"])
    except Exception as e:  # noqa: BLE001 (any hub failure is the same user error)
        raise ExportError(f"the target {verifier!r} is neither a directory nor a hub id whose config and tokenizer "
                          f"can be fetched ({e}); give the target's local directory") from None


def export_gguf(drafter, out_path: str, verifier: str, outtype: str = "f32", version: str = LLAMA_CPP_PYTHON) -> str:
    """The drafter as a llama.cpp GGUF at out_path: our zlab export (the speculators one for a family the zlab layout
    cannot carry: DSpark), through serve/export.py's gate, converted by the vendored
    convert_hf_to_gguf.py with the target's vocabulary, then read back as llama.cpp reads it (check_gguf); only a
    passing file is renamed to out_path. `verifier` is the target's Hugging Face directory."""
    import torch

    from dflash_fast.serve.export import export_drafter, trainable_state_dict

    trained = architecture(drafter.config)
    if trained["markov_rank"] and trained["markov_head_type"] != "vanilla":
        raise ExportError(f"markov_head_type={trained['markov_head_type']!r}: llama.cpp builds the vanilla Markov "
                          f"head only (src/models/dflash.cpp build_dspark_markov_head; conversion/qwen.py DSparkModel "
                          f"refuses another): train model.markov_head_type=vanilla")
    if trained["lilicorr_candidate_topk"]:
        raise ExportError(f"lilicorr_candidate_topk={trained['lilicorr_candidate_topk']}: llama.cpp's DFlash "
                          f"(src/models/dflash.cpp) has no LiLiCorr lattice and would serve the backbone alone; "
                          f"export a LiLiCorr drafter with --format zlab for vLLM (docs/lilicorr.md)")
    target = target_description(verifier)
    taps = target_tap_problems(trained["layer_ids"], target["architecture"], target["num_layers"])
    if taps:
        raise ExportError("; ".join(taps))
    out_path = os.path.abspath(out_path)
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    work = tempfile.mkdtemp(prefix=os.path.basename(out_path) + ".tmp-", dir=os.path.dirname(out_path))
    try:
        dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[outtype]
        # the converter takes the z-lab layout (DFlashModel), or the speculators one for a family the z-lab layout
        # cannot carry (conversion/qwen.py DSparkModel: DSparkDraftModel, aux_hidden_state_layer_ids - 1)
        fmt = "zlab" if LAYOUTS[drafter.config.family].zlab_architecture else "speculators"
        export = export_drafter(drafter, os.path.join(work, fmt), verifier, dtype, fmt=fmt)
        tmp = convert(export, os.path.join(work, "draft.gguf"), verifier, outtype, version)
        check_gguf(tmp, trained, target)
        written = {k: v.to(dtype) for k, v in trainable_state_dict(drafter).items()}
        problems = tensor_problems(tmp, written)
        if problems:
            raise ExportError(f"{tmp}: the converter wrote other tensors than the drafter's: " + "; ".join(problems))
        os.replace(tmp, out_path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out_path


if __name__ == "__main__":  # the child process of `convert`: SRC then convert_hf_to_gguf.py's own arguments
    _run_converter(sys.argv[1], sys.argv[2:])


__all__ = ["ARCHITECTURE", "build_tools", "check_gguf", "convert", "export_gguf", "gguf_architecture"]
