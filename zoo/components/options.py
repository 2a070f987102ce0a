"""Option checking shared by every component: unknown names are rejected with a close-match hint."""
from __future__ import annotations

import difflib
import functools
import json
import math
import inspect
import re


@functools.lru_cache(maxsize=2048)
def _parameters(init) -> tuple[inspect.Parameter, ...]:
    """``init``'s parameters, read once (components are made often: a router per MoE layer)."""
    return tuple(inspect.signature(init).parameters.values())


def accepted_options(cls, skip=()) -> list[str]:
    """Named keyword parameters of ``__init__`` along the class's MRO (``**options`` collects the rest)."""
    names: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for p in _parameters(init):
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self" and p.name not in skip:
                if p.name not in names:
                    names.append(p.name)
    return names


def suggest(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=3, cutoff=0.5)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def check_options(cls, options: dict, skip=()) -> None:
    """Unknown names are refused (with close matches), and so are values of the wrong type for a parameter
    annotated ``int``, ``float``, ``bool`` or ``str`` (optionally ``| None``): 2.7 is never truncated to 2."""
    accepted = accepted_options(cls, skip)
    label = getattr(cls, "name", "") or cls.__name__
    types = annotated_types(cls)
    for key, value in options.items():
        if key not in accepted:
            raise ValueError(
                f"unknown option {key!r} for {label}{suggest(key, accepted)} (accepted: {', '.join(accepted) or 'none'})"
            )
        expected = types.get(key)
        if expected is not None and not _is(value, *expected):
            kind = expected[0].__name__ + (" or None" if expected[1] else "")
            kind += " (finite)" if expected[0] is float else ""
            raise ValueError(f"option {key!r} of {label} must be {kind}, got {value!r}")


def required_options(cls, skip=()) -> list[str]:
    """``__init__`` parameters without a default (e.g. a pruner's ``num_experts``)."""
    init = cls.__init__
    return [p.name for p in _parameters(init)
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty
            and p.name != "self" and p.name not in skip]


_SIMPLE = {"int": int, "float": float, "bool": bool, "str": str}


def annotated_types(cls) -> dict[str, tuple[type, bool]]:
    """``{parameter: (type, None allowed)}`` for ``__init__`` parameters with a simple annotation."""
    out: dict[str, tuple[type, bool]] = {}
    for klass in reversed(cls.__mro__):
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for p in _parameters(init):
            ann = p.annotation
            ann = ann if isinstance(ann, str) else ann.__name__ if isinstance(ann, type) else str(ann)
            parts = [a.strip() for a in ann.split("|")]
            optional = "None" in parts
            parts = [a for a in parts if a != "None"]
            if len(parts) == 1 and parts[0] in _SIMPLE:
                out[p.name] = (_SIMPLE[parts[0]], optional)
            else:
                out.pop(p.name, None)
    return out


def _is(value, kind: type, optional: bool) -> bool:
    if value is None:
        return optional
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, (int, float)) and math.isfinite(value)
    return isinstance(value, kind)


def parse_step(step: str) -> tuple[str, dict]:
    """A recipe step written ``name:k=v,k2=v2`` -> (name, options); values are parsed as JSON where they can be
    (``steer:disable={"1":[0,2]}``), else kept as text. A malformed item is a ValueError."""
    name, _, rest = step.partition(":")
    options = {}
    for item in filter(None, _split_top_level(rest)):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"option {item!r} in step {step!r} must look like key=value")
        key = key.strip()
        if not key:
            raise ValueError(f"option {item!r} in step {step!r} has no name before '='")
        if key in options:
            raise ValueError(f"option {key!r} is given twice in step {step!r}: give it once")
        try:
            options[key] = json.loads(value, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError:
            options[key] = value
    return name.strip(), options


def _unique_keys(pairs) -> dict:
    """A JSON object with each key once (``{"1": [0], "1": [2]}`` would silently keep the last)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} is given twice in one JSON object: give it once")
        out[key] = value
    return out


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets and quotes, so JSON values such as ``disable={"1":[0,2]}`` stay whole."""
    parts, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]


def check_int(name: str, value, low: int, high: int | None = None) -> int:
    """``value`` must be an integer (not a bool) in [low, high]; a ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        span = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {span}, got {value!r}")
    return value


def check_float(name: str, value, low: float, high: float | None = None) -> float:
    """``value`` must be a finite number (not a bool) in [low, high]; returned as a float."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not low <= value <= (math.inf if high is None else high)):
        span = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be a number in {span}, got {value!r}")
    return float(value)



def describe_options(cls, skip=()) -> list[dict]:
    """Every named ``__init__`` option of ``cls`` along its MRO (the most derived signature wins), as
    ``{"name", "type", "default", "required", "help"}``: ``type`` is the annotation as written (else the default's
    type, else ""), ``default`` is None where there is none (then ``required`` is true), and ``help`` is the text
    after ``:param name:`` or ``name:`` on a line of the class's or an ``__init__``'s docstring (else "")."""
    params: dict[str, inspect.Parameter] = {}
    annotations: dict[str, str] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for p in _parameters(init):
            if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) or p.name == "self" or p.name in skip:
                continue
            params.setdefault(p.name, p)
            if p.annotation is not p.empty and p.name not in annotations:
                ann = p.annotation
                annotations[p.name] = ann if isinstance(ann, str) else getattr(ann, "__name__", None) or str(ann)
    docs = option_docs(cls)
    out = []
    for name, p in params.items():
        required = p.default is p.empty
        default = None if required else p.default
        kind = annotations.get(name) or ("" if default is None else type(default).__name__)
        out.append({"name": name, "type": kind, "default": default, "required": required,
                    "help": docs.get(name, "")})
    return out


def option_docs(cls) -> dict[str, str]:
    """``{option: one line of help}`` from ``:param name: text`` / ``name: text`` lines (``name`` may be in
    backticks, followed by a ``(type)``, after a ``-`` bullet) in the docstrings of ``cls``, its bases and their
    ``__init__`` methods (the most derived first; torch's own classes aside)."""
    line = re.compile(r"^\s*(?:[-*]\s+)?(?::param\s+(?:[\w\[\], |.]+\s+)?(\w+)\s*:|`{0,2}(\w+)`{0,2}\s*"
                      r"(?:\([^)]*\))?\s*:)\s*(\S.*?)\s*$")
    docs: dict[str, str] = {}
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] in ("builtins", "torch", "abc"):
            continue
        init = klass.__dict__.get("__init__")
        for doc in (klass.__dict__.get("__doc__"), getattr(init, "__doc__", None)):
            for text in (doc or "").splitlines():
                m = line.match(text)
                if m:
                    docs.setdefault(m.group(1) or m.group(2), m.group(3))
    return docs
