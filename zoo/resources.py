"""Find shipped files (``cards/...``, ``spaces/...``) in a source checkout, an installed wheel, or beside a
third-party component's own module."""
from __future__ import annotations

import inspect
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
_INSTALLED = {"cards": "_cards", "spaces": "_spaces"}


def resource_path(relative: str, owner: object | None = None) -> Path:
    """``cards/topk-softmax.md`` -> an existing path: beside ``owner``'s module (third-party plugins ship
    their own cards), then the checkout, then the installed package data."""
    top, _, rest = relative.partition("/")
    candidates = []
    if owner is not None:
        cls = owner if isinstance(owner, type) else type(owner)
        try:
            candidates.append(Path(inspect.getfile(cls)).resolve().parent / relative)
        except (TypeError, OSError):
            pass
    candidates += [_ROOT / relative, Path(__file__).resolve().parent / _INSTALLED.get(top, top) / rest]
    for candidate in candidates:
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"{relative} is neither beside its component, in the checkout, nor installed")
