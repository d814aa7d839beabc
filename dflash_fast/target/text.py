"""Conversation text as every stage takes it: the roles accepted (ShareGPT's names are aliases) and the check that a
record's text can reach the target's tokenizer, with the failure of the target's own chat template or tokenizer on
one record's text turned into a TextError naming the record.
"""

from typing import Optional

# Conversation roles every stage accepts (ShareGPT's names are aliases).
ROLE_ALIASES = {"human": "user", "gpt": "assistant", "model": "assistant"}


KNOWN_ROLES = ("system", "user", "assistant", "tool")


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
