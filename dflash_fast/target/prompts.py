"""Prompts for generation, shared by regeneration and evaluation (HF and vLLM alike): a prompt file's records read as
chat messages or plain text, encoded through the target's chat template, the target loaded for generation, its EOS
ids, and a response cut where the target stops.

    read_prompts    JSONL {conversations: [...]} / {text: ...} (or records in memory) -> [Prompt]
    encode_prompt   a Prompt -> token ids (the chat template with the generation prompt, or the text); `thinking`
                    sets the template's thinking switch (thinking_switch: Qwen3 / gpt-oss)
    prompt_tokenizer  the tokenizer eval and validation encode with, warning when their thinking setting is not the
                    training data's (thinking_mismatch)
    load_model      the target for generation (eval, regenerate --engine hf)
    eos_token_ids   the ids that end a response; cut_response: a generated response cut there or at the budget
    decode_reply    a response's tokens -> the assistant turn's fields (gpt-oss: analysis and final channels split)
"""

import json
import os
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Union

import torch

from dflash_fast.store.format import torch_dtype
from dflash_fast.target.datasets_in import dataset_rows, is_dataset, to_record
from dflash_fast.target.harmony import is_harmony, split_channels
from dflash_fast.target.load import load_target
from dflash_fast.target.text import KNOWN_ROLES, ROLE_ALIASES, TextError, on_text, text_problem


@dataclass
class Prompt:
    """One input record: `messages` (chat) or `text` (plain continuation), never both."""

    index: int
    record: Dict
    messages: Optional[List[Dict[str, str]]] = None
    text: Optional[str] = None
    where: str = ""  # FILE:LINE (or "record i"), for errors


def _messages(turns, where: str) -> List[Dict[str, str]]:
    """Normalised chat turns up to and including the last user turn."""
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where}: 'conversations' must be a non-empty list of {{role, content}} objects")
    messages = []
    for i, t in enumerate(turns):
        role = t.get("role", t.get("from")) if isinstance(t, dict) else None
        role = ROLE_ALIASES.get(role, role)
        content = t.get("content", t.get("value")) if isinstance(t, dict) else None
        if role not in KNOWN_ROLES or not isinstance(content, str):
            raise ValueError(f"{where}: each turn needs a role in {KNOWN_ROLES} and text content, got {t!r}")
        problem = text_problem(content)
        if problem:
            raise ValueError(f"{where}: the content of turn {i} {problem}")
        message = {"role": role, "content": content}
        if isinstance(t.get("tool_calls"), list):  # an earlier assistant turn's calls: part of the prompt
            message["tool_calls"] = t["tool_calls"]
        messages.append(message)
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise ValueError(f"{where}: the conversation has no user turn to respond to")
    return messages[: users[-1] + 1]


def read_prompts(data: Union[str, Sequence[Dict]], num_prompts: Optional[int] = None,
                 split: str = "train") -> List[Prompt]:
    """Prompts from a JSONL path, a Hugging Face dataset (datasets_in: rows of `split`, mapped by their preset) or
    a list of records; blank lines are not records.

    Every record is checked before any model loads; a bad one raises with its line number (or row).
    """
    if isinstance(data, (str, os.PathLike)) and is_dataset(data):
        records = [(where, to_record(row)) for where, row in dataset_rows(str(data), split, num_prompts)]
    elif isinstance(data, (str, os.PathLike)):
        records = []
        with open(data) as f:
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    try:
                        records.append((f"{data}:{line_no}", json.loads(line)))
                    except (json.JSONDecodeError, RecursionError) as e:
                        raise ValueError(f"{data}:{line_no}: not valid JSON ({e}); fix or delete the line") from None
    else:
        records = [(f"record {i}", r) for i, r in enumerate(data)]
    if num_prompts is not None:
        records = records[:num_prompts]
    if not records:
        raise ValueError(f"no prompts in {data if isinstance(data, (str, os.PathLike)) else 'the given records'}")
    prompts = []
    for index, (where, r) in enumerate(records):
        if isinstance(r, dict) and "conversations" in r:
            prompts.append(Prompt(index, r, messages=_messages(r["conversations"], where), where=where))
        elif isinstance(r, dict) and isinstance(r.get("text"), str):
            problem = text_problem(r["text"])
            if problem:
                raise ValueError(f"{where}: 'text' {problem}")
            prompts.append(Prompt(index, r, text=r["text"], where=where))
        else:
            raise ValueError(f"{where}: expected an object with 'conversations' (chat) or 'text' (string)")
    return prompts


def thinking_switch(tokenizer, thinking: Optional[bool]) -> Dict[str, object]:
    """The chat-template keyword that turns the target's thinking on or off ({} for None, the template's default):
    Qwen3's `enable_thinking`; gpt-oss's `reasoning_effort`, "high" for on and "low" for off (gpt-oss always
    reasons; low is its least). Which one is read from the template's own text, as z-lab's benchmark does."""
    if thinking is None:
        return {}
    template = str(getattr(tokenizer, "chat_template", None) or "")
    if "enable_thinking" in template:
        return {"enable_thinking": thinking}
    if "reasoning_effort" in template:
        return {"reasoning_effort": "high" if thinking else "low"}
    raise ValueError(
        f"--thinking {'on' if thinking else 'off'}: the target's chat template has no thinking switch (neither "
        "Qwen3's enable_thinking nor gpt-oss's reasoning_effort); leave --thinking out for this target"
    )


def thinking_state(tokenizer, thinking: Optional[bool]) -> Optional[str]:
    """Whether a prompt rendered with the switch `thinking` (None: the template's default) has the target think:
    "on" or "off", found by rendering a one-turn chat each way; None for a template without the switch."""
    try:
        on, off = thinking_switch(tokenizer, True), thinking_switch(tokenizer, False)
    except ValueError:
        return None
    chat = [{"role": "user", "content": "x"}]
    render = lambda kwargs: tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, **kwargs)
    given = render(thinking_switch(tokenizer, thinking))
    return "on" if given == render(on) else "off" if given == render(off) else None


def thinking_mismatch(trained: Dict[str, int], state: Optional[str], prompts: str) -> Optional[str]:
    """One warning line when the prompts (`prompts` names them and their setting) render with the target thinking
    `state` while the training conversations (`trained`: the store's extraction.thinking counts) were rendered with
    the other setting; None when they agree, or when either side does not say."""
    other = {k: n for k, n in trained.items() if k != state and n}
    if state is None or not other:
        return None
    total = sum(trained.values())
    return (f"warning: {prompts} render with thinking {state}, but {sum(other.values())} of the {total} training "
            f"conversations were rendered with thinking {', '.join(other)}: acceptance here is measured on another "
            f"distribution than the drafter learned (docs/troubleshooting.md#thinking-on-in-training-off-in-serving)")


def prompt_tokenizer(target: str, thinking: Optional[str], trained: Dict[str, int], prompts: str,
                     trust_remote_code: bool = False):
    """The target's tokenizer for prompts rendered with `thinking` ("on" / "off"; None or "": the template's
    default), and the switch encode_prompt takes for it (True / False / None). A template without the switch is
    refused before any model loads; one line on stderr (thinking_mismatch) when the prompts, `prompts` naming them,
    render with another setting than the `trained` conversations (a store's extraction.thinking counts) ->
    (tokenizer, switch)."""
    from transformers import AutoTokenizer

    think = {"on": True, "off": False, "": None}.get(thinking, thinking)
    tokenizer = AutoTokenizer.from_pretrained(target, trust_remote_code=trust_remote_code)
    thinking_switch(tokenizer, think)
    line = thinking_mismatch(trained, thinking_state(tokenizer, think), prompts)
    if line:
        print(line, file=sys.stderr)
    return tokenizer, think


def thinking_of_kwargs(kwargs: Dict[str, object]) -> Optional[bool]:
    """The switch a record's chat-template keywords set (thinking_switch's keys), None when they set none."""
    if "enable_thinking" in kwargs:
        return bool(kwargs["enable_thinking"])
    if "reasoning_effort" in kwargs:
        return kwargs["reasoning_effort"] != "low"
    return None


def encode_prompt(tokenizer, prompt: Prompt, thinking: Optional[bool] = None) -> List[int]:
    """Token ids the target continues: the chat template with the generation prompt (its thinking switch set by
    `thinking`, see thinking_switch), or the text with the tokenizer's special tokens (the conventions of
    `dflash-fast extract`)."""
    where = prompt.where or f"prompt {prompt.index}"
    try:
        if prompt.messages is not None:
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError(
                    "the target's tokenizer has no chat template; give {'text': ...} prompts instead of conversations"
                )
            text = on_text("the chat template", tokenizer.apply_chat_template, prompt.messages, tokenize=False,
                           add_generation_prompt=True, tools=prompt.record.get("tools"),
                           **thinking_switch(tokenizer, thinking))
            ids = on_text("the tokenizer", tokenizer, text, add_special_tokens=False)["input_ids"]
        elif thinking is not None:
            raise ValueError("--thinking sets the chat template's switch; a {'text': ...} prompt has no template: "
                             "give {'conversations': [...]} prompts or leave --thinking out")
        else:
            ids = on_text("the tokenizer", tokenizer, prompt.text, add_special_tokens=True)["input_ids"]
    except TextError as e:
        raise ValueError(f"{where}: {e}") from None
    if not ids:
        raise ValueError(f"{where} is empty after tokenization; give it some text")
    return ids


def load_model(target: str, device=None, dtype: Optional[str] = None, trust_remote_code: bool = False):
    """The target in eval mode: cuda when present (bf16 by default), else cpu (fp32 by default)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    compute = torch_dtype(dtype) if dtype else torch.bfloat16 if device.type == "cuda" else torch.float32
    return load_target(target, device, compute, trust_remote_code)


ENGINES = ("hf", "vllm")


def add_model_arguments(p) -> None:
    """The flags of `load_model`'s options, for the commands that load the target with it (regenerate, eval)."""
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the target's own modelling code to run")


def eos_token_ids(generation_config, tokenizer) -> List[int]:
    """Every token that ends a response: the (target's) generation config's eos ids and the tokenizer's."""
    ids = getattr(generation_config, "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def cut_response(tokens: Sequence[int], max_new_tokens: int, eos: Sequence[int]) -> List[int]:
    """New tokens as every engine reports them: at most max_new_tokens, ending after the first eos."""
    tokens = list(tokens)[:max_new_tokens]
    end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:end]


def decode_reply(tokenizer, tokens: Sequence[int]) -> Optional[Dict]:
    """A generated response as the assistant turn's fields the chat template renders it back from: {"content"}
    (special tokens left out; Qwen3's `<think>...</think>` is text and stays in it), or for a harmony target
    (gpt-oss) {"thinking": the analysis channel, "content": the final channel}, or a function call's {"thinking",
    "content": "", "tool_calls"}. None when a harmony response is neither (harmony.split_channels): the caller
    keeps its text."""
    if is_harmony(tokenizer):
        return split_channels(tokenizer.decode(tokens, skip_special_tokens=False))
    return {"content": tokenizer.decode(tokens, skip_special_tokens=True)}
