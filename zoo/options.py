"""Option checking shared by every component: unknown names are rejected with a close-match hint."""
from __future__ import annotations

import difflib
import inspect


def accepted_options(cls, skip=()) -> list[str]:
    """Named keyword parameters of ``__init__`` along the class's MRO (``**options`` collects the rest)."""
    names: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for p in inspect.signature(init).parameters.values():
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self" and p.name not in skip:
                if p.name not in names:
                    names.append(p.name)
    return names


def suggest(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=3, cutoff=0.5)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def check_options(cls, options: dict, skip=()) -> None:
    accepted = accepted_options(cls, skip)
    for key in options:
        if key not in accepted:
            label = getattr(cls, "name", "") or cls.__name__
            raise ValueError(
                f"unknown option {key!r} for {label}{suggest(key, accepted)} (accepted: {', '.join(accepted) or 'none'})"
            )
