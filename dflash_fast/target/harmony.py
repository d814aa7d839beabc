"""gpt-oss's harmony format read back from generated text: a reply's `analysis` and `final` channels split into the
turn's `thinking` and `content`, the fields gpt-oss's chat template renders them from.

    <|channel|>analysis<|message|>{thinking}<|end|><|start|>assistant<|channel|>final<|message|>{content}<|return|>

This follows the documented format (openai-harmony's "Response format": messages of `<|start|>{role}<|channel|>
{channel}<|message|>{text}` closed by `<|end|>`, `<|return|>` or `<|call|>`) on the text; the `openai-harmony`
package installs on a CPU machine but loads its tokenizer's vocabulary from the network, so it is not used here.
"""
from typing import Dict, Optional

CHANNEL, MESSAGE, NEXT = "<|channel|>", "<|message|>", "<|start|>assistant"
STOPS = ("<|end|>", "<|return|>", "<|call|>")


def is_harmony(tokenizer) -> bool:
    """The target's chat template writes harmony channels (gpt-oss)."""
    return CHANNEL in str(getattr(tokenizer, "chat_template", None) or "")


def split_channels(text: str) -> Optional[Dict[str, str]]:
    """A generated reply (the text after the generation prompt `<|start|>assistant`, special tokens kept) ->
    {"thinking": analysis, "content": final} (thinking only when an analysis message is there; content "" when the
    reply stopped before its final message), or None when it is not at most one analysis then at most one final
    message (a tool call's commentary channel, free text): such a reply is kept as text."""
    fields = {}
    for part in text.split(NEXT):
        if not part.startswith(CHANNEL) or MESSAGE not in part:
            return None
        header, body = part[len(CHANNEL):].split(MESSAGE, 1)
        channel = (header.split() or [""])[0]
        key = {"analysis": "thinking", "final": "content"}.get(channel)
        if key is None or key in fields or (key == "thinking" and "content" in fields):
            return None
        cut = min((body.find(s) for s in STOPS if s in body), default=len(body))
        fields[key] = body[:cut]
    fields.setdefault("content", "")
    return fields
