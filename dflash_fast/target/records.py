"""JSONL records -> tokenized documents: what `dflash-fast extract` (and the online mode) feeds the target.

Three record formats, mixed freely: `{"conversations": [{role, content}, ...]}` rendered with the target's chat
template (with the record's `"tools"`, and assistant `tool_calls`, when it has them), with `loss_mask` 1 exactly on
what the assistant generates (a conversation whose template re-renders earlier turns, as Qwen3's drops their reasoning,
becomes one row per assistant turn: ChatTokenizer.conversation_rows; the reasoning span trained, masked or dropped:
REASONING_MODES); `{"text": ...}`, every token trained; and
`{"input_ids": [...], "loss_mask": [...]}` taken as is. A malformed line stops the run naming `FILE:LINE` (or is
counted with --skip-bad); over-long documents are truncated and counted; records without a trainable token are
skipped and counted by reason (InputStats). A Hugging Face dataset (datasets_in) yields the same records, one a row.
"""
import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

from dflash_fast.target.datasets_in import NoPreset, dataset_rows, is_dataset, to_record
from dflash_fast.target.prompts import thinking_of_kwargs, thinking_state, thinking_switch
from dflash_fast.target.text import KNOWN_ROLES, ROLE_ALIASES, TextError, on_text, text_problem


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
    thinking: Counter = field(default_factory=Counter)  # conversations rendered with the target thinking "on" / "off"

    def to_dict(self) -> dict:
        return {
            "lines": self.lines,
            "sequences": self.sequences,
            "bad_lines": self.bad_lines,
            "truncated": self.truncated,
            "skipped": dict(sorted(self.skipped.items())),
            "thinking": dict(sorted(self.thinking.items())),
        }


REASONING_KEYS = ("thinking", "reasoning_content")
# data.reasoning / extract --reasoning: train on the reasoning span, keep it in the context without loss, remove it.
REASONING_MODES = ("train", "mask", "drop")
THINK_END = "</think>"
MEDIA_KEYS = ("images", "image", "videos", "video", "pixel_values")
IMAGES_UNSUPPORTED = ("image and video inputs are not supported yet: extraction feeds the target text only "
                      "(multimodal checkpoints included), so remove them from the data")


def has_image(content) -> bool:
    """A turn's content in the multimodal message format with an image or video part."""
    return isinstance(content, list) and any(
        isinstance(part, dict) and (part.get("type") in ("image", "image_url", "input_image", "video")
                                    or "image" in part or "image_url" in part)
        for part in content)


def reasoning_of(message) -> str:
    """An assistant message's reasoning: its `reasoning_content` / `thinking`, or the text before `</think>`."""
    for key in REASONING_KEYS:
        if isinstance(message.get(key), str):
            return message[key]
    content = message.get("content") or ""
    return content.split(THINK_END)[0].split("<think>")[-1] if THINK_END in content else ""


def without_reasoning(message) -> dict:
    """The message as a reply without reasoning: no reasoning field, the content after `</think>`."""
    message = {k: v for k, v in message.items() if k not in REASONING_KEYS}
    if THINK_END in message["content"]:
        message["content"] = message["content"].split(THINK_END)[-1].lstrip("\n")
    return message


def reasoning_end(text, start, end, reasoning, special=()) -> int:
    """Where the reasoning the template rendered in `text[start:end]` (an assistant turn's trained span, which the
    reasoning opens) ends: after `</think>` and the whitespace after it, or after the reasoning text and the special
    token that closes it (harmony's `<|end|>` of the analysis channel); `start` when the span holds none."""
    think = text.find(THINK_END, start, end)
    if think >= 0:
        cut = think + len(THINK_END)
        while cut < end and text[cut].isspace():
            cut += 1
        return cut
    found = text.find(reasoning.strip(), start, end) if reasoning.strip() else -1
    if found < 0:
        return start
    cut = found + len(reasoning.strip())
    closing = next((t for t in special if text.startswith(t, cut)), "")
    return min(end, cut + len(closing))


def chat_messages(turns, tools, reasoning: str):
    """Checked chat messages of a record's turns (its `conversations` and `tools`), the reasoning of each assistant
    turn removed under reasoning=drop (REASONING_MODES)."""
    if not isinstance(turns, list) or not turns:
        raise BadLine("'conversations' must be a non-empty list of {role, content} objects")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise BadLine("'tools' must be a list of function-definition objects")
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
            if isinstance(t.get("tool_calls"), list):  # rendered by the template, trained as the reply
                message["tool_calls"] = t["tool_calls"]
            if reasoning == "drop":
                message = without_reasoning(message)
        for key, value in message.items():
            problem = None if key == "tool_calls" else text_problem(value)
            if problem:
                raise BadLine(f"the {key} of turn {i} {problem}")
        messages.append(message)
    if not any(m["role"] == "assistant" for m in messages):
        raise Skip("no assistant turn")
    return messages


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
    That is the single row (conversation); conversation_rows, what training reads, gives such a template's
    conversation one row per assistant turn instead. reasoning=mask takes each turn's reasoning out of its
    mask, reasoning=drop out of the turn.
    """

    def __init__(self, tokenizer, vocab_size: int, reasoning: str = "train"):
        if reasoning not in REASONING_MODES:
            raise ValueError(f"reasoning {reasoning!r}: choose one of {REASONING_MODES} (train the reasoning span, "
                             "keep it in the context without loss, or remove it)")
        self.tok = tokenizer
        self.vocab_size = vocab_size
        self.reasoning = reasoning
        self._turn_suffix = None
        self._generation_prompt = None
        self._thinking: Dict[Optional[bool], Optional[str]] = {}  # switch -> thinking_state, rendered once each
        self._special = sorted((t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                                if t.special), key=len, reverse=True)

    def _render(self, messages, generation_prompt=False, tools=None, template_kwargs=None) -> str:
        return self.tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                            add_generation_prompt=generation_prompt, **(template_kwargs or {}))

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

    def _assistant_spans(self, messages, text, tools=None, template_kwargs=None):
        spans, cursor = [], 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                # Advance past other turns, so a user turn quoting a later reply is not taken for it.
                found = text.find(m["content"], cursor) if m["content"] else -1
                cursor = found + len(m["content"]) if found >= 0 else cursor
                continue
            try:
                head = self._render(messages[:i], generation_prompt=True, tools=tools, template_kwargs=template_kwargs)
                upto = self._render(messages[: i + 1], tools=tools, template_kwargs=template_kwargs)
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

    def _messages(self, turns, tools):
        """chat_messages of a record's turns, for a tokenizer that gives character offsets."""
        messages = chat_messages(turns, tools, self.reasoning)
        if not getattr(self.tok, "is_fast", False):
            raise ValueError("conversations need a fast (Rust) tokenizer for character offsets; the target's is slow")
        return messages

    def _template_kwargs(self, record_kwargs):
        """The chat template's keywords: the record's `chat_template_kwargs` (regenerate writes its --thinking
        switch there), and under reasoning=drop the template's thinking switch off where it has one."""
        if record_kwargs is not None and not (isinstance(record_kwargs, dict) and all(isinstance(k, str)
                                                                                    for k in record_kwargs)):
            raise BadLine("'chat_template_kwargs' must be an object of keyword -> value")
        kwargs = dict(record_kwargs or {})
        if self.reasoning == "drop":
            try:
                kwargs.update(thinking_switch(self.tok, False))
            except ValueError:  # no switch: the template renders no reasoning of its own
                pass
        return kwargs

    def _example(self, text, spans, messages) -> Example:
        """Tokens of `text`, the loss mask on the character `spans` of the assistant turns `messages` (reasoning=mask:
        less each turn's reasoning)."""
        enc = on_text("the tokenizer", self.tok, text, add_special_tokens=False, return_offsets_mapping=True)
        starts = np.array([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
        mask = np.zeros(len(starts), dtype=bool)
        for (a, b), m in zip(spans, messages):
            if self.reasoning == "mask":
                a = reasoning_end(text, a, b, reasoning_of(m), self._special)
            mask |= (starts >= a) & (starts < b)
        return Example(np.asarray(enc["input_ids"], dtype=np.int32), mask)

    def conversation(self, turns, tools=None, template_kwargs=None) -> Example:
        """One row: the whole conversation rendered once, every assistant turn trained as the template renders it.
        `tools`: the function definitions the chat template renders (a record's "tools"), or None;
        `template_kwargs`: the record's chat_template_kwargs."""
        messages = self._messages(turns, tools)
        kwargs = self._template_kwargs(template_kwargs)
        text = on_text("the chat template", self._render, messages, tools=tools, template_kwargs=kwargs)
        spans = self._assistant_spans(messages, text, tools, kwargs)
        return self._example(text, spans, [m for m in messages if m["role"] == "assistant"])

    def _served_row(self, sub, sub_text, head):
        """(text, span) of the last turn of `sub` as it was served, where the template renders the history before it
        otherwise than in the turn's prompt `head` (gpt-oss's drops a tool call's analysis once an answer follows it):
        `head`, then the turn as `sub_text` renders it last, from the generation prompt after the content of the
        (user or tool) message before it. None when the turn follows no such message or that text is not found."""
        prompt, turn = self.generation_prompt(), sub[-1]
        before = sub[-2] if len(sub) > 1 else {"role": "assistant"}
        if head is None or not prompt or not head.endswith(prompt) or before["role"] == "assistant" or \
                not before["content"]:
            return None
        first = next((turn[k] for k in (*REASONING_KEYS, "content") if isinstance(turn.get(k), str) and turn[k]), "")
        bound = sub_text.rfind(first) if first else len(sub_text)
        found = sub_text.rfind(before["content"], 0, max(bound, 0))
        start = sub_text.find(prompt, found + len(before["content"])) if found >= 0 else -1
        if start < 0:
            return None
        text = head + sub_text[start + len(prompt):]
        return text, (len(head), len(text))

    def conversation_rows(self, turns, tools=None, template_kwargs=None) -> List[Example]:
        """The rows a conversation trains as: one row when the template renders every assistant turn in the full
        conversation as it renders it last (the prefix property), else one row per assistant turn i, the
        conversation up to it rendered with turn i last and only turn i trained. A template that re-renders
        earlier turns (Qwen3's drops their reasoning) then trains each turn in the context the target served it
        in: the prompt of turn i, then what the target generated."""
        messages = self._messages(turns, tools)
        kwargs = self._template_kwargs(template_kwargs)
        text = on_text("the chat template", self._render, messages, tools=tools, template_kwargs=kwargs)
        turns_at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        try:
            per_turn = any(not text.startswith(self._render(messages[: i + 1], tools=tools, template_kwargs=kwargs))
                           for i in turns_at[:-1])
        except Exception:  # a template that refuses a partial chat: the single row's search handles it
            per_turn = False
        if not per_turn:
            return [self._example(text, self._assistant_spans(messages, text, tools, kwargs),
                                  [messages[i] for i in turns_at])]
        rows = []
        for i in turns_at:
            sub = messages[: i + 1]
            sub_text = on_text("the chat template", self._render, sub, tools=tools, template_kwargs=kwargs)
            try:
                head = self._render(messages[:i], generation_prompt=True, tools=tools, template_kwargs=kwargs)
            except Exception:  # a template that refuses this partial chat: the search below
                head = None
            if head is not None and sub_text.startswith(head) and len(sub_text) > len(head):  # after turn i's prompt
                span = (len(head), len(sub_text))
            elif (served := self._served_row(sub, sub_text, head)) is not None:
                sub_text, span = served
            else:  # the search of the single row (a template that renders a last turn otherwise)
                span = self._assistant_spans(sub, sub_text, tools, kwargs)[-1]
            rows.append(self._example(sub_text, [span], [sub[-1]]))
        return rows

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

    def rows(self, record) -> List[Example]:
        """The training rows of a record: conversation_rows for a conversation, else its one Example."""
        if isinstance(record, dict) and "conversations" in record and not any(k in record for k in MEDIA_KEYS):
            return self.conversation_rows(record["conversations"], record.get("tools"),
                                          record.get("chat_template_kwargs"))
        return [self.record(record)]

    def thinking_of(self, record) -> Optional[str]:
        """"on" / "off": whether the template rendered a conversation `record` (a valid one) with the target thinking,
        its chat_template_kwargs and reasoning=drop considered; None for a text record or a template without the
        switch. What the store records (extraction.thinking) and validation / eval compare their prompts with."""
        if not (isinstance(record, dict) and "conversations" in record):
            return None
        switch = thinking_of_kwargs(self._template_kwargs(record.get("chat_template_kwargs")))
        if switch not in self._thinking:
            self._thinking[switch] = thinking_state(self.tok, switch)
        return self._thinking[switch]

    def record(self, record) -> Example:
        """A record as one row (conversations rendered once: see conversation_rows for the rows training reads)."""
        if not isinstance(record, dict):
            raise BadLine("a line must be a JSON object")
        media = [k for k in MEDIA_KEYS if k in record]
        if media:
            raise BadLine(f"the record holds {media[0]!r}; {IMAGES_UNSUPPORTED}")
        if "conversations" in record:
            return self.conversation(record["conversations"], record.get("tools"), record.get("chat_template_kwargs"))
        if "text" in record:
            return self.text(record["text"])
        if "input_ids" in record:
            return self.pretokenized(record["input_ids"], record.get("loss_mask"))
        raise BadLine("expected a 'conversations', 'text' or 'input_ids' key")


def _jsonl_records(path, digest, max_samples=None):
    """(FILE:LINE, read) of each non-blank line of a JSONL file (the first `max_samples`); `digest` takes the bytes
    read. read() parses the line, raising BadLine."""
    def parse(raw):
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadLine(f"not valid JSON ({e})") from None
        except RecursionError:
            raise BadLine("not valid JSON (nested too deeply to parse)") from None

    records = 0
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if max_samples is not None and records >= max_samples:
                return
            digest.update(raw)
            if raw.strip():
                records += 1
                yield f"{path}:{line_no}", lambda raw=raw: parse(raw)


def _dataset_records(data, digest, split, max_samples):
    """(where, read) of each row of a Hugging Face dataset (datasets_in); `digest` takes each row as sorted JSON,
    the dataset's identity. read() maps the row through its preset, raising NoPreset."""
    for where, row in dataset_rows(data, split, max_samples):
        digest.update(json.dumps(row, sort_keys=True, default=str).encode() + b"\n")
        yield where, lambda row=row: to_record(row)


def read_examples(path, tokenizer: ChatTokenizer, max_seq_len, skip_bad=False, rank=0, world_size=1, split="train",
                  max_samples=None):
    """Tokenize this rank's records of a JSONL file (every `world_size`-th non-blank line) or of a Hugging Face
    dataset (datasets_in.is_dataset: rows of `split`, mapped by their preset); at most the first `max_samples`.

    Returns (examples, InputStats, sha256 of the data read). Over-long
    sequences are truncated to `max_seq_len` and counted; records without any
    trainable token are skipped and counted by reason.
    """
    stats, examples, digest = InputStats(), [], hashlib.sha256()
    record_no = 0
    records = (_dataset_records(path, digest, split, max_samples) if is_dataset(path)
               else _jsonl_records(path, digest, max_samples))
    for where, read in records:
        record_no += 1
        if (record_no - 1) % world_size != rank:
            continue
        stats.lines += 1
        try:
            record = read()
            rows = tokenizer.rows(record)
        except (BadLine, NoPreset, TextError) as e:
            if not skip_bad:
                raise BadLine(f"{where}: {e}; fix the line or pass --skip-bad to skip such lines") from None
            stats.bad_lines += 1
            continue
        except Skip as e:
            stats.skipped[str(e)] += 1
            continue
        state = tokenizer.thinking_of(record)
        if state is not None:
            stats.thinking[state] += 1
        for ex in rows:
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
        raise ValueError(f"{path} is empty: expected one JSON record a line (or dataset rows)")
    return examples, stats, digest.hexdigest()
