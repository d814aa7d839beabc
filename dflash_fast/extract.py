"""`dflash-fast extract`: run a frozen Hugging Face target over JSONL data and write a store.

    JSONL ──tokenize──▶ sequences ──plan──▶ shards ──batches──▶ target forward ──▶ store

Per token it keeps the outputs of the tapped decoder layers (`hidden`), the
residual entering the final norm (`last`, captured by a hook on the norm) and
the teacher's next-token summary (top-k ids/logits and the full log-sum-exp)
taken from the logits the forward computes anyway (SPEC.md §1-2, store.py).

Before anything is written, and again every `parity_every` batches, the
extractor recomputes `lm_head(final_norm(last))` with the norm kind it will
record in the manifest and checks it against the model's own logits: a hook on
the wrong tensor or a mis-described norm aborts the run instead of producing a
store that trains a drafter against the wrong teacher. An fp8 store's `last` is
checked once more as training will read it back (dequantised), at fp8's tolerance.

Ranks launched by torchrun or the deepspeed launcher (RANK / WORLD_SIZE /
LOCAL_RANK) take every WORLD_SIZE-th JSONL record, write their own shards,
and leave a note in `ranks/`; rank 0 waits for every note and writes the one
manifest.
"""
import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from dflash_fast.eager import rms_norm
from dflash_fast.errors import COUNT, NUMBER, STR, ListOf, MapOf, Obj, UserError
from dflash_fast.lock import output_lock
from dflash_fast.store import (
    DTYPES,
    FP8,
    MANIFEST,
    SCALE_FIELDS,
    SHARD_ENTRY,
    SHARDS_DIR,
    HiddenStateStore,
    Layout,
    StoreWriter,
    build_manifest,
    check_layer_ids,
    default_layer_ids,
    dequantize_fp8,
    final_norm_weight,
    normalise_dtype,
    parse_layer_ids,
    quantize_fp8,
    read_json,
    read_manifest,
    write_json_atomic,
)
from dflash_fast.target import (
    KNOWN_ROLES,
    ROLE_ALIASES,
    TextError,
    check_target,
    config_sha256,
    detect_norm_kind,
    final_norm_module,
    load_target,
    on_text,
    tapped_layers,
    text_problem,
)

RANKS_DIR = "ranks"
# Parity tolerance on |lm_head(norm(last)) - logits|, relative to the largest |logit|.
PARITY_RTOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}
# The same check on `last` as an fp8 store holds it (dequantised): e4m3 moves each element by up to 2^-4 of
# itself, so the logits move by a few percent of their scale; 2^-3 is twice the per-element bound and still
# far below what a wrong tensor gives (tests/test_extract.py measures both).
PARITY_RTOL_FP8 = 0.125
LOGIT_CHUNK = 2048  # tokens per fp32 top-k / lse chunk: bounds the fp32 copy of [n, V]


# ---------------------------------------------------------------- input

class BadLine(ValueError):
    """A JSONL line that is not a record this extractor understands."""


class Skip(Exception):
    """A well-formed record that yields no trainable sequence; the message is the counted reason."""


@dataclass
class Example:
    """One document: input_ids [n] int32, loss_mask [n] bool."""

    input_ids: np.ndarray
    loss_mask: np.ndarray


@dataclass
class InputStats:
    lines: int = 0
    sequences: int = 0
    bad_lines: int = 0
    truncated: int = 0
    skipped: Counter = field(default_factory=Counter)

    def to_dict(self) -> dict:
        return {
            "lines": self.lines,
            "sequences": self.sequences,
            "bad_lines": self.bad_lines,
            "truncated": self.truncated,
            "skipped": dict(sorted(self.skipped.items())),
        }


REASONING_KEYS = ("thinking", "reasoning_content")
MEDIA_KEYS = ("images", "image", "videos", "video", "pixel_values")
IMAGES_UNSUPPORTED = ("image and video inputs are not supported yet: extraction feeds the target text only "
                      "(multimodal checkpoints included), so remove them from the data")


def has_image(content) -> bool:
    """A turn's content in the multimodal message format with an image or video part."""
    return isinstance(content, list) and any(
        isinstance(part, dict) and (part.get("type") in ("image", "image_url", "input_image", "video")
                                    or "image" in part or "image_url" in part)
        for part in content)


class ChatTokenizer:
    """Tokenizes the three JSONL formats; builds the assistant-only loss mask of conversations.

    The mask of assistant turn `i` covers the text between the rendered prefix
    `messages[:i]` + generation prompt and the rendered prefix `messages[:i+1]`:
    everything the target generates after the generation prompt (its reasoning
    when the turn carries `thinking` / `reasoning_content`, channel headers such
    as harmony's, the reply and the end-of-turn marker), never the role header.
    Templates that re-render earlier turns differently (e.g. dropping reasoning
    from old turns) break that prefix property; then the reply's content (or,
    when the template dropped it, the part after `</think>`) is located in the
    full rendering, reaches back to the end of the generation prompt before it,
    and is extended by the template's end-of-turn text or the special token
    that closes it (harmony's `<|end|>`, where the last turn has `<|return|>`).
    """

    def __init__(self, tokenizer, vocab_size: int):
        self.tok = tokenizer
        self.vocab_size = vocab_size
        self._turn_suffix = None
        self._generation_prompt = None
        self._special = sorted((t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                                if t.special), key=len, reverse=True)

    def _render(self, messages, generation_prompt=False) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def generation_prompt(self) -> str:
        """The text add_generation_prompt appends, e.g. '<|im_start|>assistant\n' or harmony's '<|start|>assistant'."""
        if self._generation_prompt is None:
            chat = [{"role": "user", "content": "hi"}]
            try:
                bare, prompted = self._render(chat), self._render(chat, generation_prompt=True)
            except Exception:  # a template that refuses this chat: no generation prompt to reach back to
                bare, prompted = "", ""
            self._generation_prompt = prompted[len(bare):] if prompted.startswith(bare) else ""
        return self._generation_prompt

    def turn_suffix(self) -> str:
        """The text a template emits after an assistant reply's content, e.g. '<|im_end|>\\n'."""
        if self._turn_suffix is None:
            marker = "\u2063dflash-reply\u2063"
            text = self._render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}])
            self._turn_suffix = text[text.index(marker) + len(marker):] if marker in text else ""
        return self._turn_suffix

    def _assistant_spans(self, messages, text):
        spans, cursor = [], 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                # Advance past other turns, so a user turn quoting a later reply is not taken for it.
                found = text.find(m["content"], cursor) if m["content"] else -1
                cursor = found + len(m["content"]) if found >= 0 else cursor
                continue
            try:
                head = self._render(messages[:i], generation_prompt=True)
                upto = self._render(messages[: i + 1])
            except Exception:  # templates reject partial chats in their own ways: use the search below
                head = upto = None
            if head is not None and text.startswith(upto) and upto.startswith(head) and len(upto) > len(head):
                spans.append((len(head), len(upto)))
                cursor = len(upto)
                continue
            content = m["content"]
            start = text.find(content, cursor) if content else -1
            if start < 0 and "</think>" in content:
                # Reasoning templates (Qwen3's) render earlier turns without their <think> part: the answer is what the
                # target sees, and what the drafter trains on.
                content = content.split("</think>")[-1].lstrip("\n")
                start = text.find(content, cursor) if content else -1
            if start < 0:
                raise Skip("assistant turn not found in the chat template's output")
            end = start + len(content)
            prompt = self.generation_prompt()
            header = text.rfind(prompt, cursor, start) if prompt else -1
            if header >= 0:  # what the target generated before the content (harmony's channel header) trains too
                start = header + len(prompt)
            closing = next((t for t in self._special if text.startswith(t, end)), "")
            end += len(self.turn_suffix()) if text.startswith(self.turn_suffix(), end) else len(closing)
            spans.append((start, end))
            cursor = end
        return spans

    def conversation(self, turns) -> Example:
        if not isinstance(turns, list) or not turns:
            raise BadLine("'conversations' must be a non-empty list of {role, content} objects")
        messages = []
        for i, t in enumerate(turns):
            if not isinstance(t, dict):
                raise BadLine("each turn must be an object with 'role' and 'content'")
            role = t.get("role", t.get("from"))
            content = t.get("content", t.get("value"))
            role = ROLE_ALIASES.get(role, role)
            if role not in KNOWN_ROLES:
                raise Skip(f"unknown role {role!r}")
            if has_image(content):
                raise BadLine(f"turn {i} holds an image; {IMAGES_UNSUPPORTED}")
            if not isinstance(content, str):
                raise Skip("turn content is not text")
            message = {"role": role, "content": content}
            if role == "assistant":
                # Reasoning as the template takes it: `thinking` (gpt-oss's analysis channel), `reasoning_content`.
                message.update((k, t[k]) for k in REASONING_KEYS if isinstance(t.get(k), str))
            for key, value in message.items():
                problem = text_problem(value)
                if problem:
                    raise BadLine(f"the {key} of turn {i} {problem}")
            messages.append(message)
        if not any(m["role"] == "assistant" for m in messages):
            raise Skip("no assistant turn")
        if not getattr(self.tok, "is_fast", False):
            raise ValueError("conversations need a fast (Rust) tokenizer for character offsets; the target's is slow")
        text = on_text("the chat template", self._render, messages)
        spans = self._assistant_spans(messages, text)
        enc = on_text("the tokenizer", self.tok, text, add_special_tokens=False, return_offsets_mapping=True)
        starts = np.array([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
        mask = np.zeros(len(starts), dtype=bool)
        for a, b in spans:
            mask |= (starts >= a) & (starts < b)
        return Example(np.asarray(enc["input_ids"], dtype=np.int32), mask)

    def text(self, text) -> Example:
        if not isinstance(text, str):
            raise BadLine("'text' must be a string")
        problem = text_problem(text)
        if problem:
            raise BadLine(f"'text' {problem}")
        ids = on_text("the tokenizer", self.tok, text, add_special_tokens=True)["input_ids"]
        return Example(np.asarray(ids, dtype=np.int32), np.ones(len(ids), dtype=bool))

    def pretokenized(self, ids, mask) -> Example:
        mask = [1] * len(ids) if mask is None and isinstance(ids, list) else mask
        if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask):
            raise BadLine("'input_ids' and 'loss_mask' must be lists of the same length")
        if not all(isinstance(i, int) and 0 <= i < self.vocab_size for i in ids):
            raise BadLine(f"'input_ids' must be integers in 0..{self.vocab_size - 1} (the target's vocabulary)")
        if not all(m in (0, 1) for m in mask):
            raise BadLine("'loss_mask' must hold only 0 and 1")
        return Example(np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=bool))

    def record(self, record) -> Example:
        if not isinstance(record, dict):
            raise BadLine("a line must be a JSON object")
        media = [k for k in MEDIA_KEYS if k in record]
        if media:
            raise BadLine(f"the record holds {media[0]!r}; {IMAGES_UNSUPPORTED}")
        if "conversations" in record:
            return self.conversation(record["conversations"])
        if "text" in record:
            return self.text(record["text"])
        if "input_ids" in record:
            return self.pretokenized(record["input_ids"], record.get("loss_mask"))
        raise BadLine("expected a 'conversations', 'text' or 'input_ids' key")


def read_examples(path, tokenizer: ChatTokenizer, max_seq_len, skip_bad=False, rank=0, world_size=1):
    """Tokenize this rank's records of a JSONL file (every `world_size`-th non-blank line).

    Returns (examples, InputStats, sha256 of the whole file). Over-long
    sequences are truncated to `max_seq_len` and counted; records without any
    trainable token are skipped and counted by reason.
    """
    stats, examples, digest = InputStats(), [], hashlib.sha256()
    record_no = 0
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            digest.update(raw)
            if not raw.strip():
                continue
            record_no += 1
            if (record_no - 1) % world_size != rank:
                continue
            stats.lines += 1
            try:
                try:
                    record = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise BadLine(f"not valid JSON ({e})") from None
                except RecursionError:
                    raise BadLine("not valid JSON (nested too deeply to parse)") from None
                ex = tokenizer.record(record)
            except (BadLine, TextError) as e:
                if not skip_bad:
                    raise BadLine(f"{path}:{line_no}: {e}; fix the line or pass --skip-bad to skip such lines") \
                        from None
                stats.bad_lines += 1
                continue
            except Skip as e:
                stats.skipped[str(e)] += 1
                continue
            if len(ex.input_ids) > max_seq_len:
                ex = Example(ex.input_ids[:max_seq_len], ex.loss_mask[:max_seq_len])
                stats.truncated += 1
            if len(ex.input_ids) == 0:
                stats.skipped["empty after tokenization"] += 1
                continue
            if not ex.loss_mask.any():
                stats.skipped["no loss tokens (after truncation)"] += 1
                continue
            examples.append(ex)
            stats.sequences += 1
    if record_no == 0:
        raise ValueError(f"{path} is empty: expected one JSON record a line")
    return examples, stats, digest.hexdigest()


# ---------------------------------------------------------------- the target forward


class TargetRunner:
    """One forward of the target per batch; returns per-sequence arrays in the store's layout."""

    def __init__(self, model, layer_ids, layout: Layout, pad_id: int, parity_every: int):
        self.model = model
        self.config = model.config.get_text_config()
        self.num_layers = self.config.num_hidden_layers
        self.layer_ids = list(layer_ids)
        self.layout = layout
        self.pad_id = pad_id
        self.parity_every = parity_every
        self.norm, self.norm_name = final_norm_module(model)
        self.norm_kind, self.norm_eps = detect_norm_kind(self.norm)
        self.lm_head = model.get_output_embeddings()
        self.vocab_size = self.lm_head.weight.shape[0]
        self.device = next(model.parameters()).device
        self.batches_run = 0
        self._captured = []
        self.norm.register_forward_pre_hook(lambda _module, args: self._captured.append(args[0]))

    def _forward(self, examples):
        """Right-padded forward -> logits [b, T, V], hidden [b, T, K, H], last [b, T, H]."""
        t = max(len(e.input_ids) for e in examples)
        ids = torch.full((len(examples), t), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(examples), t), dtype=torch.long)
        for r, e in enumerate(examples):
            ids[r, : len(e.input_ids)] = torch.from_numpy(e.input_ids)
            mask[r, : len(e.input_ids)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        self._captured.clear()
        out = self.model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
        if len(self._captured) != 1:
            raise UserError(
                f"the final norm {self.norm_name} ran {len(self._captured)} times in one forward, not once"
            )
        last = self._captured.pop()
        states = out.hidden_states
        if len(states) != self.num_layers + 1:
            raise UserError(f"the target returned {len(states)} hidden states, expected L+1 = {self.num_layers + 1}")
        return out.logits, torch.stack(tapped_layers(states, last, self.layer_ids), dim=2), last

    def check_parity(self, logits, last, lengths, rtol=None, what="last") -> None:
        """lm_head(final_norm(last)) must reproduce the model's own logits, with the recorded norm kind.

        logits [b, T, V], last [b, T, H]; row r is valid up to lengths[r]. rtol: relative to the largest
        |logit|, default PARITY_RTOL of the logits' dtype.
        """
        scale = final_norm_weight(self.norm.weight, self.norm_kind)
        rtol = PARITY_RTOL[logits.dtype] if rtol is None else rtol
        last = last.to(logits.dtype)
        for r, n in enumerate(lengths):
            for a in range(0, n, LOGIT_CHUNK):
                b = min(n, a + LOGIT_CHUNK)
                got = self.lm_head(rms_norm(last[r, a:b], scale, self.norm_eps)).float()
                want = logits[r, a:b].float()
                err = (got - want).abs().max().item()
                bound = rtol * max(want.abs().max().item(), 1.0)
                if not err <= bound:
                    raise UserError(
                        f"parity check failed: lm_head({self.norm_name}({what})) differs from the model's logits by "
                        f"{err:.3g} (tolerance {bound:.3g}, norm kind {self.norm_kind}); `last` is not the input of "
                        f"the final norm or the norm is mis-described. Nothing was written for this batch."
                    )

    def _as_stored(self, name: str, x: torch.Tensor) -> Dict[str, torch.Tensor]:
        """`hidden` or `last` in the store's dtype: {name: x} cast, or for fp8 {name: q, name_scale: scale}."""
        if self.layout.dtype == FP8:
            q, scale = quantize_fp8(x)
            return {name: q, SCALE_FIELDS[name]: scale}
        return {name: x.to(DTYPES[self.layout.dtype][1])}

    @torch.inference_mode()
    def __call__(self, examples: Sequence[Example]) -> List[Dict[str, np.ndarray]]:
        logits, hidden, last = self._forward(examples)
        stored = self._as_stored("hidden", hidden)
        if self.layout.has_last:
            stored.update(self._as_stored("last", last))
        if self.batches_run % self.parity_every == 0:
            lengths = [len(e.input_ids) for e in examples]
            self.check_parity(logits, last, lengths)
            if self.layout.has_last and self.layout.dtype == FP8:
                # What training will read back must still reproduce the teacher, at fp8's tolerance.
                stored_last = dequantize_fp8(stored["last"], stored["last_scale"], logits.dtype)
                self.check_parity(logits, stored_last, lengths, PARITY_RTOL_FP8, "last as stored in fp8")
        self.batches_run += 1
        stored = {name: _to_numpy(x) for name, x in stored.items()}
        k = self.layout.topk
        out = []
        for r, e in enumerate(examples):
            n = len(e.input_ids)
            top_v, top_i, lse = [], [], []
            for a in range(0, n, LOGIT_CHUNK):
                chunk = logits[r, a: min(n, a + LOGIT_CHUNK)].float()
                v, i = torch.topk(chunk, k, dim=-1, sorted=True)
                top_v.append(v)
                top_i.append(i)
                lse.append(torch.logsumexp(chunk, dim=-1))
            arrays = {
                "input_ids": e.input_ids,
                "loss_mask": e.loss_mask,
                **{name: x[r, :n] for name, x in stored.items()},
                "teacher_topk_ids": torch.cat(top_i).to(torch.int32).cpu().numpy(),
                "teacher_topk_logits": torch.cat(top_v).cpu().numpy(),
                "teacher_lse": torch.cat(lse).cpu().numpy(),
            }
            out.append(arrays)
        return out


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """CPU numpy copy; bf16 and fp8 keep their bits as uint16 and uint8 (numpy has neither)."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.uint16)
    elif t.dtype == torch.float8_e4m3fn:
        t = t.view(torch.uint8)
    return t.cpu().numpy()


# ---------------------------------------------------------------- planning

def plan_shards(lengths: Sequence[int], shard_tokens: int) -> List[range]:
    """Consecutive sequences, cut before a shard would exceed `shard_tokens` (a shard holds >= 1 sequence)."""
    shards, start, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and tokens + n > shard_tokens:
            shards.append(range(start, i))
            start, tokens = i, 0
        tokens += n
    if start < len(lengths):
        shards.append(range(start, len(lengths)))
    return shards


def plan_batches(lengths: Sequence[int], batch_tokens: int) -> List[List[int]]:
    """Group indices so that (batch size x longest length) <= batch_tokens; longest first, so an
    out-of-memory shows in the first batch. A sequence longer than the budget runs alone."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[current[0]] > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def _inputs_sha256(examples: Sequence[Example]) -> str:
    h = hashlib.sha256()
    for e in examples:
        h.update(np.int64(len(e.input_ids)).tobytes())
        h.update(e.input_ids.tobytes())
        h.update(e.loss_mask.tobytes())
    return h.hexdigest()


def _launcher_env(rank, world_size):
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    return rank, world_size


def _default_device():
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


# ---------------------------------------------------------------- the stage

@dataclass(frozen=True)
class ExtractOptions:
    """Everything `dflash-fast extract` takes besides target, data and out (the CLI flags of the same names)."""

    layer_ids: Optional[Sequence[int]] = None  # None: num_tapped ids spread over 1..L-3
    num_tapped: int = 5
    max_seq_len: int = 2048
    batch_tokens: int = 16384
    dtype: str = "bf16"
    shard_tokens: Optional[int] = None  # None: about 1 GiB per shard
    topk: int = 8
    no_last: bool = False
    skip_bad: bool = False
    trust_remote_code: bool = False
    parity_every: int = 50
    engine: str = "hf"  # hf: transformers in this process; vllm: dflash_fast.vllm_extract
    tensor_parallel_size: int = 1  # vllm only

    def __post_init__(self):
        if self.topk < 1:
            raise ValueError(f"topk must be >= 1 (the argmax is always kept), got {self.topk}")
        if self.parity_every < 1:
            raise ValueError(f"parity_every must be >= 1, got {self.parity_every}")
        if self.tensor_parallel_size != 1 and self.engine != "vllm":
            raise ValueError("--tensor-parallel-size is the engine's: it needs --engine vllm")


@dataclass
class Job:
    """One extraction run on one rank, planned and validated before the model loads."""

    target: str
    data: str
    out: Optional[str]
    options: ExtractOptions
    rank: int
    world_size: int
    device: torch.device
    compute_dtype: torch.dtype
    config: object  # the target's transformers config
    layer_ids: List[int]
    layout: Layout
    shard_tokens: int
    tokenizer: object
    examples: List[Example]
    stats: InputStats
    identity: dict  # what makes two runs the same extraction
    id: str  # sha256 of `identity`


def plan_job(target: str, data: str, out: Optional[str], options: ExtractOptions, device=None, rank=None,
             world_size=None) -> Job:
    """Check the layer ids against the target's config and tokenize this rank's JSONL records -> Job.
    `rank` / `world_size` default to the launcher's RANK / WORLD_SIZE; `out` is None when nothing is written
    (online training)."""
    from transformers import AutoConfig, AutoTokenizer

    rank, world_size = _launcher_env(rank, world_size)
    check_target(target)
    device = torch.device(device) if device is not None else _default_device()
    dtype = normalise_dtype(options.dtype)
    compute_dtype = torch.bfloat16 if device.type == "cuda" and dtype != "float32" else torch.float32
    config = AutoConfig.from_pretrained(target, trust_remote_code=options.trust_remote_code)
    text_config = config.get_text_config()
    num_layers, vocab_size = text_config.num_hidden_layers, text_config.vocab_size
    layer_ids = options.layer_ids
    layer_ids = check_layer_ids(default_layer_ids(num_layers, options.num_tapped) if layer_ids is None else layer_ids,
                                num_layers)
    if options.topk > vocab_size:
        raise ValueError(f"topk {options.topk} exceeds the vocabulary size {vocab_size}")
    layout = Layout(len(layer_ids), text_config.hidden_size, options.topk, dtype, not options.no_last)
    shard_tokens = options.shard_tokens or max(1, (1 << 30) // layout.bytes_per_token())
    tokenizer = AutoTokenizer.from_pretrained(target, trust_remote_code=options.trust_remote_code)
    examples, stats, data_sha = read_examples(
        data, ChatTokenizer(tokenizer, vocab_size), options.max_seq_len, options.skip_bad, rank, world_size
    )
    identity = {
        "schema_version": layout.schema_version,
        "target_config_sha256": config_sha256(target),
        "data_sha256": data_sha,
        "layer_ids": layer_ids,
        "dtype": dtype,
        "compute_dtype": str(compute_dtype).replace("torch.", ""),
        "has_last": layout.has_last,
        "topk": options.topk,
        "max_seq_len": options.max_seq_len,
        "shard_tokens": shard_tokens,
        "world_size": world_size,
    }
    job_id = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return Job(target, data, out, options, rank, world_size, device, compute_dtype, config, layer_ids, layout,
               shard_tokens, tokenizer, examples, stats, identity, job_id)


def make_runner(job: Job) -> TargetRunner:
    """Load the job's target (frozen, in its compute dtype, on its device) and wrap it in a TargetRunner."""
    if job.options.engine == "vllm":
        from dflash_fast.vllm_extract import VllmRunner

        return VllmRunner(job)
    model = load_target(job.target, job.device, job.compute_dtype, job.options.trust_remote_code)
    pad_id = job.tokenizer.pad_token_id if job.tokenizer.pad_token_id is not None else 0
    return TargetRunner(model, job.layer_ids, job.layout, pad_id, job.options.parity_every)


def job_manifest(job: Job, runner: "TargetRunner") -> dict:
    """The store's manifest before its shards are counted (rank 0 adds those when every rank is done)."""
    config, target = job.config, job.target
    return build_manifest(
        target={
            "path": os.path.abspath(target) if os.path.isdir(target) else target,
            "config_sha256": job.identity["target_config_sha256"],
            "architectures": list(getattr(config, "architectures", None) or [type(runner.model).__name__]),
            "model_type": config.model_type,
        },
        num_layers=runner.num_layers,
        vocab_size=runner.vocab_size,
        layer_ids=job.layer_ids,
        layout=job.layout,
        compute_dtype=job.identity["compute_dtype"],
        final_norm={"kind": runner.norm_kind, "eps": runner.norm_eps, "module": runner.norm_name},
        extraction={
            "job": job.id,
            "engine": job.options.engine,
            "data": os.path.abspath(job.data),
            **{k: job.identity[k] for k in ("data_sha256", "max_seq_len", "shard_tokens", "world_size")},
        },
    )


# ---------------------------------------------------------------- disk


class NotEnoughDisk(UserError):
    """The store would not fit on the filesystem of --out."""


def free_bytes(path: str) -> int:
    """Free bytes for an unprivileged writer on the filesystem that holds `path` (or its nearest existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def estimate_disk(job: Job) -> dict:
    """What the store of `job` takes on disk, before anything is written.

    Returns tokens (this rank's), `fields` (name -> dtype, per-token shape, bytes per token, bytes), `total`,
    `per_dtype` (the same store in every store dtype), `remaining` (bytes of this rank's shards not yet complete
    in --out), `needed` (remaining x world_size: ranks take every world_size-th record, so their shares are
    near equal, and they all write to --out's filesystem), `free`.
    """
    lengths = [len(e.input_ids) for e in job.examples]
    tokens = sum(lengths)
    nbytes = job.layout.field_bytes()
    fields = {
        name: {"dtype": str(dtype).replace("torch.", ""), "shape": list(shape), "bytes_per_token": nbytes[name],
               "bytes": nbytes[name] * tokens}
        for name, (_, shape, dtype) in job.layout.fields().items()
    }
    shards_dir = os.path.join(job.out, SHARDS_DIR)
    remaining = sum(
        sum(lengths[i] for i in seqs)
        for s, seqs in enumerate(plan_shards(lengths, job.shard_tokens))
        if not os.path.isdir(os.path.join(shards_dir, StoreWriter.shard_name(job.rank, s)))  # a committed shard
    ) * job.layout.bytes_per_token()
    return {
        "tokens": tokens,
        "fields": fields,
        "total": job.layout.bytes_per_token() * tokens,
        "per_dtype": {d: replace(job.layout, dtype=d).bytes_per_token() * tokens for d in DTYPES},
        "remaining": remaining,
        "needed": remaining * job.world_size,
        "free": free_bytes(job.out),
    }


def check_disk(job: Job, disk: dict) -> None:
    """Refuse to start when --out's filesystem has less free space than the shards still to write."""
    if disk["needed"] > disk["free"]:
        ranks = f" ({job.world_size} ranks x {_size(disk['remaining'])} each)" if job.world_size > 1 else ""
        raise NotEnoughDisk(
            f"{job.out}: the store needs {disk['needed']:,} bytes ({_size(disk['needed'])}){ranks} but its filesystem "
            f"has {disk['free']:,} bytes ({_size(disk['free'])}) free; free space, choose another --out, or a smaller "
            f"--dtype (fp8 is half of bf16); `dflash-fast extract --estimate ...` prints the breakdown"
        )


def _size(nbytes: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def format_estimate(job: Job, disk: dict) -> str:
    """The --estimate report: tokens x bytes per token per field, the total per dtype, free space."""
    lines = [
        f"{job.data}: {job.stats.sequences} sequences, {disk['tokens']:,} tokens "
        f"({job.stats.truncated} truncated to {job.options.max_seq_len}, skipped: {dict(job.stats.skipped) or 'none'})"
        + (f"; rank {job.rank} of {job.world_size}" if job.world_size > 1 else ""),
        f"{'field':<20} {'dtype':<14} {'shape':<12} {'bytes/token':>11} {'total':>12}",
    ]
    for name, f in disk["fields"].items():
        lines.append(f"{name:<20} {f['dtype']:<14} {str(f['shape']):<12} {f['bytes_per_token']:>11,} "
                     f"{_size(f['bytes']):>12}")
    lines.append(f"{'total':<48} {job.layout.bytes_per_token():>11,} {_size(disk['total']):>12}")
    lines.append("in another --dtype: " + ", ".join(
        f"{d} {_size(n)}" for d, n in disk["per_dtype"].items() if d != job.layout.dtype))
    verdict = "enough" if disk["needed"] <= disk["free"] else "NOT ENOUGH: extraction would refuse to start"
    lines.append(f"{job.out}: {_size(disk['needed'])} still to write, {_size(disk['free'])} free ({verdict})")
    return "\n".join(lines)


def estimate(target, data, out, device=None, rank: Optional[int] = None, world_size: Optional[int] = None,
             **options) -> dict:
    """`dflash-fast extract --estimate`: plan the job (tokenize, no model, nothing written), print and return
    the disk it needs (estimate_disk)."""
    job = plan_job(str(target), str(data), str(out), ExtractOptions(**options), device, rank, world_size)
    disk = estimate_disk(job)
    print(format_estimate(job, disk))
    return disk


def extract(target, data, out, device=None, rank: Optional[int] = None, world_size: Optional[int] = None,
            progress: bool = True, **options) -> dict:
    """Extract a store from `target` over `data` (JSONL) into `out`; resume when `out` holds a partial run.

    `options` are ExtractOptions fields. Inputs are validated before the model loads (layer ids against the
    target's config, every JSONL record of this rank). Returns a summary dict (tokens run, bytes written,
    seconds, GB/s, input counts; `num_sequences` and `num_tokens` of the finished store on rank 0).
    """
    job = plan_job(str(target), str(data), str(out), ExtractOptions(**options), device, rank, world_size)
    check_disk(job, estimate_disk(job))  # before anything is written, the lock's directory included
    with output_lock(job.out, job.rank):
        return _extract(job, progress)


def _extract(job: Job, progress: bool) -> dict:
    """extract() of a planned job, holding the lock of its output directory."""
    if _complete_store(job.out, job.id, job.rank):
        run = {"tokens_run": 0, "bytes_written": 0, "seconds": 0.0, "skipped_shards": None}
        return _summarise(job.out, job.rank, job.stats, run, progress)
    runner = make_runner(job)
    manifest = job_manifest(job, runner)
    writer = StoreWriter(job.out, job.layout)
    writer.remove_torn(job.rank)
    note_path = os.path.join(job.out, RANKS_DIR, f"rank{job.rank:05d}.json")
    os.makedirs(os.path.dirname(note_path), exist_ok=True)
    if os.path.exists(note_path):
        os.remove(note_path)
    entries, run = _run_shards(writer, runner, job.examples, job.rank, job.id, job.shard_tokens,
                               job.options.batch_tokens, progress)
    write_json_atomic(note_path, {"job": job.id, "shards": entries, "input": job.stats.to_dict(), "run": run})
    if job.rank == 0:
        notes = _wait_for_ranks(job.out, job.world_size, job.id)
        _finish(writer, manifest, notes)
        # Report the whole job: ranks ran in parallel, so the slowest one sets the time.
        run = {k: sum(n["run"][k] for n in notes) for k in ("tokens_run", "bytes_written", "skipped_shards")}
        run["seconds"] = max(n["run"]["seconds"] for n in notes)
    return _summarise(job.out, job.rank, job.stats, run, progress)


def _run_shards(writer, runner, examples, rank, job_id, shard_tokens, batch_tokens, progress):
    """Extract this rank's shards, keeping complete ones -> (manifest shard entries, run counters)."""
    lengths = [len(e.input_ids) for e in examples]
    bar = _progress_bar(sum(lengths), rank, progress)
    entries, bytes_written, tokens_run, skipped_shards, done = [], 0, 0, 0, 0
    t0 = time.time()
    for s, seqs in enumerate(plan_shards(lengths, shard_tokens)):
        name = writer.shard_name(rank, s)
        shard_examples = [examples[i] for i in seqs]
        shard_lengths = [lengths[i] for i in seqs]
        meta = {"job": job_id, "inputs_sha256": _inputs_sha256(shard_examples)}
        entries.append({
            "name": name,
            "num_sequences": len(seqs),
            "num_tokens": int(sum(shard_lengths)),
            "num_loss_tokens": int(sum(int(e.loss_mask.sum()) for e in shard_examples)),
        })
        if writer.is_complete(name, shard_lengths, meta):
            skipped_shards += 1
            done += len(seqs)
            bar.update(sum(shard_lengths))
            continue
        shard = None
        try:
            for batch in plan_batches(shard_lengths, batch_tokens):
                arrays = runner([shard_examples[i] for i in batch])
                # Opened after the shard's first forward, so a failed first parity check writes nothing.
                shard = shard or writer.open_shard(name, shard_lengths, meta)
                for i, a in zip(batch, arrays):
                    shard.write(i, a)
                done += len(batch)
                bar.update(sum(shard_lengths[i] for i in batch))
                bar.set_postfix(seq=done)
            shard.commit()
        finally:
            if shard is not None:
                shard.close()
        bytes_written += shard.bytes_written
        tokens_run += int(sum(shard_lengths))
    bar.close()
    run = {"tokens_run": tokens_run, "bytes_written": bytes_written, "seconds": time.time() - t0,
           "skipped_shards": skipped_shards}
    return entries, run


def _complete_store(out, job_id, rank) -> bool:
    """True when `out` already holds the finished store of this very job; refuse a different one.

    A manifest of this job over damaged or missing shards no longer tells the
    truth: rank 0 removes it and the run redoes what is missing.
    """
    manifest = read_manifest(out)
    if manifest is None:
        return False
    if manifest.get("extraction", {}).get("job") != job_id:
        raise ValueError(
            f"{out} already holds a complete store from a different extraction (target, data or settings differ); "
            f"use a new --out directory or delete {out}"
        )
    try:
        HiddenStateStore(out)
    except (FileNotFoundError, ValueError) as e:
        print(f"{out}: the finished store is damaged ({e}); redoing what is missing", file=sys.stderr)
        if rank == 0:
            os.remove(os.path.join(out, MANIFEST))
        return False
    return True


def _wait_for_ranks(out, world_size, job_id, poll_s=0.2) -> List[dict]:
    """File barrier: each rank leaves ranks/rankNNNNN.json once its shards are complete."""
    notes, next_report = {}, time.time() + 60
    while True:
        for r in range(world_size):
            path = os.path.join(out, RANKS_DIR, f"rank{r:05d}.json")
            if r not in notes and os.path.exists(path):
                note = read_json(path, "a rank's note", RANK_NOTE)
                if note["job"] == job_id:
                    notes[r] = note
        if len(notes) == world_size:
            return [notes[r] for r in range(world_size)]
        if time.time() > next_report:
            missing = [r for r in range(world_size) if r not in notes]
            print(f"rank 0: waiting for ranks {missing} to finish their shards", file=sys.stderr)
            next_report = time.time() + 60
        time.sleep(poll_s)


# What a rank leaves in ranks/ when its shards are complete (read by rank 0: _wait_for_ranks).
RANK_NOTE = Obj({
    "job": STR,
    "shards": ListOf(Obj({**SHARD_ENTRY.required, "num_loss_tokens": COUNT})),
    "input": Obj({**dict.fromkeys(("lines", "sequences", "bad_lines", "truncated"), COUNT), "skipped": MapOf(COUNT)}),
    "run": Obj({"tokens_run": COUNT, "bytes_written": COUNT, "seconds": NUMBER}),
})


def _finish(writer: StoreWriter, manifest: dict, notes: List[dict]) -> None:
    """Rank 0: one manifest over every rank's shards, then remove the rank notes."""
    shards = [entry for note in notes for entry in note["shards"]]
    inputs = [note["input"] for note in notes]
    skipped = Counter()
    for i in inputs:
        skipped.update(i["skipped"])
    counts = {k: sum(i[k] for i in inputs) for k in ("lines", "sequences", "bad_lines", "truncated")}
    if not shards:
        raise ValueError(f"no usable sequences in the data: {counts}, skipped {dict(skipped)}")
    writer.write_manifest({
        **manifest,
        "num_sequences": sum(e["num_sequences"] for e in shards),
        "num_tokens": sum(e["num_tokens"] for e in shards),
        "num_loss_tokens": sum(e["num_loss_tokens"] for e in shards),
        "shards": shards,
        "extraction": {**manifest["extraction"], "input": {**counts, "skipped": dict(sorted(skipped.items()))}},
    })
    shutil.rmtree(os.path.join(writer.path, RANKS_DIR), ignore_errors=True)


def _progress_bar(total_tokens, rank, progress):
    from tqdm import tqdm

    return tqdm(total=total_tokens, unit="tok", unit_scale=True, desc="extract", disable=not progress or rank != 0)


def _summarise(out, rank, stats, run, progress) -> dict:
    """Summary dict of this call (all ranks on rank 0); rank 0 also prints it."""
    seconds = run["seconds"]
    summary = {
        "out": out,
        "rank": rank,
        **run,
        "gb_per_s": run["bytes_written"] / 1e9 / seconds if seconds > 0 else 0.0,
        "tokens_per_s": run["tokens_run"] / seconds if seconds > 0 else 0.0,
        "input": stats.to_dict(),
    }
    m = read_manifest(out) if rank == 0 else None
    if m is None:
        return summary
    summary.update(num_sequences=m["num_sequences"], num_tokens=m["num_tokens"])
    if progress:
        i = m["extraction"]["input"]
        kept = run["skipped_shards"]
        kept = " (already complete: nothing to do)" if kept is None else (
            f", {kept} complete shards kept" if kept else "")
        print(
            f"store {out}: {m['num_sequences']} sequences, {m['num_tokens']} tokens "
            f"({m['num_loss_tokens']} with loss), layer ids {m['layer_ids']}, {m['dtype']}\n"
            f"this run: {run['tokens_run']} tokens, {run['bytes_written'] / 1e9:.3f} GB in {seconds:.1f} s "
            f"({summary['gb_per_s']:.3f} GB/s, {summary['tokens_per_s']:.0f} tok/s){kept}\n"
            f"input: {i['lines']} records, {i['bad_lines']} bad lines skipped, {i['truncated']} truncated "
            f"to {m['extraction']['max_seq_len']} tokens, skipped: {i['skipped'] or 'none'}"
        )
    return summary


# ---------------------------------------------------------------- CLI

def _layer_ids_arg(text):
    try:
        return parse_layer_ids(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser) -> None:
    p = parser
    p.add_argument("--target", required=True, help="Hugging Face causal LM: local directory or hub id")
    p.add_argument("--data", required=True, help="JSONL: {conversations: [...]}, {text: ...} or {input_ids, loss_mask}")
    p.add_argument("--out", required=True, help="store directory (re-run the same command to resume)")
    p.add_argument("--layer-ids", type=_layer_ids_arg, default=None,
                   help="comma-separated decoder layer ids, 0..L-1 (id l = HF hidden_states[l+1]); "
                        "default: --num-tapped ids spread over 1..L-3")
    p.add_argument("--num-tapped", type=int, default=5, help="K, when --layer-ids is not given (default 5)")
    p.add_argument("--max-seq-len", type=int, default=2048, help="longer sequences are truncated and counted")
    p.add_argument("--batch-tokens", type=int, default=16384, help="padded tokens per forward (default 16384)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32", "fp8"], default="bf16",
                   help="store dtype of hidden/last; fp8 = e4m3 with an fp32 scale per token and layer (half of bf16)")
    p.add_argument("--shard-tokens", type=int, default=None, help="tokens per shard (default: about 1 GiB)")
    p.add_argument("--topk", type=int, default=8, help="teacher top-k kept per token (default 8)")
    p.add_argument("--no-last", action="store_true", help="do not store `last` (stores for ce / top-k losses only)")
    p.add_argument("--skip-bad", action="store_true", help="skip and count malformed JSONL lines instead of failing")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the target's own modelling code to run")
    p.add_argument("--parity-every", type=int, default=50,
                   help="check lm_head(norm(last)) == logits on the first batch and every N batches (default 50)")
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf",
                   help="what runs the target: hf (transformers, one device) or vllm (its extract_hidden_states "
                        "path; docs/engine-target.md)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="--engine vllm: GPUs the target spans")
    p.add_argument("--estimate", action="store_true",
                   help="print the disk the store needs (tokens x bytes per token per field and dtype) and the free "
                        "space, then exit without loading the model or writing anything")


def run(args) -> int:
    (estimate if args.estimate else extract)(
        args.target, args.data, args.out,
        layer_ids=args.layer_ids, num_tapped=args.num_tapped, max_seq_len=args.max_seq_len,
        batch_tokens=args.batch_tokens, dtype=args.dtype, shard_tokens=args.shard_tokens, topk=args.topk,
        no_last=args.no_last, skip_bad=args.skip_bad, trust_remote_code=args.trust_remote_code,
        parity_every=args.parity_every, engine=args.engine, tensor_parallel_size=args.tensor_parallel_size,
    )
    return 0
