"""Find shipped files (``cards/...``, ``spaces/...``) in a source checkout or an installed wheel."""
from __future__ import annotations

from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
_INSTALLED = {"cards": "_cards", "spaces": "_spaces"}


def resource_path(relative: str) -> Path:
    """``cards/topk-softmax.md`` -> an existing path, checkout first, then the installed package data."""
    top, _, rest = relative.partition("/")
    for candidate in (_ROOT / relative, Path(__file__).resolve().parent / _INSTALLED.get(top, top) / rest):
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"{relative} is neither in the checkout nor in the installed package")
