"""Tokens never shown: errors of calls that may carry a Hugging Face token are re-raised with it masked."""
from __future__ import annotations

import itertools
import os
from contextlib import contextmanager
from pathlib import Path

MASK = "hf_***"
MIN_LEAK = 8  # this many characters of a token in a row count as a leak: messages may cut a token short


class HubError(OSError, RuntimeError):
    """A Hub error re-raised with every token masked; its cause is dropped (it may hold the request headers)."""


def known_tokens(token: str | None = None) -> list[str]:
    """Every token this process could send: ``token``, ``HF_TOKEN`` (and the older ``HUGGING_FACE_HUB_TOKEN``),
    the stored login (``huggingface_hub.get_token()``, the token file) and the named stored tokens."""
    from huggingface_hub import constants, get_token
    from huggingface_hub.utils import get_stored_tokens

    tokens = [token, os.environ.get("HF_TOKEN"), os.environ.get("HUGGING_FACE_HUB_TOKEN")]
    for source in (get_token, lambda: Path(constants.HF_TOKEN_PATH).read_text(),
                   lambda: list(get_stored_tokens().values())):
        try:  # an unreadable or broken source must not hide the error being masked
            found = source()
        except Exception:
            continue
        tokens += found if isinstance(found, list) else [found]
    return [t for t in dict.fromkeys(t.strip() for t in tokens if t) if t]


def mask_tokens(text: str, tokens: list[str]) -> str:
    """``text`` with every run of characters that belongs to a token (the whole token, or any
    ``MIN_LEAK``-or-more-character piece of it: a prefix cut short, a suffix) replaced by ``MASK``."""
    hit = [False] * len(text)
    for t in tokens:
        width = min(len(t), MIN_LEAK)
        for i in range(len(t) - width + 1):
            start = text.find(t[i:i + width])
            while start != -1:
                hit[start:start + width] = [True] * width
                start = text.find(t[i:i + width], start + 1)
    return "".join(MASK if masked else "".join(c for c, _ in run)
                   for masked, run in itertools.groupby(zip(text, hit), key=lambda pair: pair[1]))


@contextmanager
def masked_errors(token: str | None = None):
    """Re-raise an error whose traceback would show a token (``known_tokens(token)``) as a ``HubError``
    with the token masked; other errors pass through unchanged."""
    try:
        yield
    except Exception as exc:
        import traceback

        tokens, shown = known_tokens(token), "".join(traceback.format_exception(exc))
        if mask_tokens(shown, tokens) == shown:
            raise
        notes = "".join(f"\n{note}" for note in getattr(exc, "__notes__", []))
        raise HubError(mask_tokens(str(exc) + notes, tokens)) from None
