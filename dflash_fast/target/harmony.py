"""gpt-oss's harmony format read back from generated text: a reply's `analysis`, `final` and function-call
(`commentary` addressed to `functions.NAME`) messages as the turn's `thinking`, `content` and `tool_calls`, the
fields gpt-oss's chat template renders them from.

    <|channel|>analysis<|message|>{thinking}<|end|><|start|>assistant<|channel|>final<|message|>{content}<|return|>
    <|channel|>analysis<|message|>{thinking}<|end|><|start|>assistant to=functions.{name}<|channel|>commentary json
        <|message|>{arguments}<|call|>

This follows the documented format (openai-harmony's "Response format": messages of `<|start|>{role}<|channel|>
{channel}<|message|>{text}` closed by `<|end|>`, `<|return|>` or `<|call|>`; a function call's recipient `to=functions.
NAME` in the role or in the channel header, its content type `json` or `<|constrain|>json` after it) on the text;
the `openai-harmony` package installs on a CPU machine but loads its tokenizer's vocabulary from the network, so it
is not used here. gpt-oss's published template renders a call as `<|start|>assistant to=functions.NAME<|channel|>
commentary json<|message|>` + the arguments through `tojson` + `<|call|>`: a call generated in that form renders back
to its own tokens; one generated as `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>` or with
other JSON spacing renders in the template's form.
"""
import json
from typing import Dict, Optional

CHANNEL, MESSAGE, NEXT, CONSTRAIN = "<|channel|>", "<|message|>", "<|start|>assistant", "<|constrain|>"
STOPS = ("<|end|>", "<|return|>", "<|call|>")
FUNCTIONS = "functions."


def is_harmony(tokenizer) -> bool:
    """The target's chat template writes harmony channels (gpt-oss)."""
    return CHANNEL in str(getattr(tokenizer, "chat_template", None) or "")


def _recipient(words) -> Optional[str]:
    return next((w[len("to="):] for w in words if w.startswith("to=")), None)


def split_channels(text: str) -> Optional[Dict]:
    """A generated reply (the text after the generation prompt `<|start|>assistant`, special tokens kept) ->
    {"thinking": analysis, "content": final} (thinking only when an analysis message is there; content "" when the
    reply stopped before its final message), or, for a function call after at most one analysis message,
    {"thinking"?, "content": "", "tool_calls": [{"type": "function", "function": {"name", "arguments": the
    parsed JSON object}}]}. None for anything else (a commentary message to no function, a call cut before its
    `<|call|>` or with arguments that are not a JSON object, free text): such a reply is kept as text."""
    fields = {}
    for part in text.split(NEXT):
        if CHANNEL not in part or MESSAGE not in part or "tool_calls" in fields:
            return None
        role_rest, rest = part.split(CHANNEL, 1)
        header, body = rest.split(MESSAGE, 1)
        words = header.replace(CONSTRAIN, " ").split()
        channel = (words or [""])[0]
        recipient = _recipient(role_rest.split()) or _recipient(words[1:])
        if role_rest.strip() and not role_rest.split()[0].startswith("to="):
            return None
        if recipient is not None:
            if not (recipient.startswith(FUNCTIONS) and channel == "commentary" and body.endswith("<|call|>")
                    and "content" not in fields):
                return None
            try:
                arguments = json.loads(body[: -len("<|call|>")])
            except ValueError:
                return None
            if not isinstance(arguments, dict):
                return None
            fields["tool_calls"] = [{"type": "function", "function": {"name": recipient[len(FUNCTIONS):],
                                                                        "arguments": arguments}}]
            continue
        key = {"analysis": "thinking", "final": "content"}.get(channel)
        if key is None or key in fields or (key == "thinking" and "content" in fields):
            return None
        cut = min((body.find(s) for s in STOPS if s in body), default=len(body))
        fields[key] = body[:cut]
    fields.setdefault("content", "")
    return {k: fields[k] for k in ("thinking", "content", "tool_calls") if k in fields}
