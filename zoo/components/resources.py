"""Find shipped files (``cards/...``, ``spaces/...``) in a source checkout, an installed wheel, or in a
component's own package."""
from __future__ import annotations

import inspect
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
_INSTALLED = {"cards": "_cards", "spaces": "_spaces"}


def package_dirs(owner: object) -> list[Path]:
    """Where a component's own files may be (``<folder>/cards/...``, ``<folder>/spaces/<space>/``): the folder of
    its module, then the folder of the top-level package it belongs to (its distribution's package)."""
    cls = owner if isinstance(owner, type) else type(owner)
    try:
        here = Path(inspect.getfile(cls)).resolve().parent
    except (TypeError, OSError):
        return []
    top = sys.modules.get(cls.__module__.partition(".")[0])
    init = getattr(top, "__file__", None)
    root = Path(init).resolve().parent if init and Path(init).name == "__init__.py" else here
    return [here] if root == here else [here, root]


def first_party(owner: object) -> bool:
    """Whether a component is the zoo's own (its files may live in the zoo's ``cards/`` and ``spaces/``)."""
    from zoo.components.plugins import DEFAULT_PLUGINS

    cls = owner if isinstance(owner, type) else type(owner)
    return cls.__module__.partition(".")[0] in {"zoo", *(p.partition(".")[0] for p in DEFAULT_PLUGINS)}


def resource_path(relative: str, owner: object | None = None) -> Path:
    """``cards/topk-softmax.md`` -> an existing path: in ``owner``'s own package (third-party plugins ship their
    own cards), then, for the zoo's own components, the checkout and the installed package data."""
    top, _, rest = relative.partition("/")
    candidates = [folder / relative for folder in package_dirs(owner)] if owner is not None else []
    if owner is None or first_party(owner):
        candidates += [_ROOT / relative, Path(__file__).resolve().parents[1] / _INSTALLED.get(top, top) / rest]
    for candidate in candidates:
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"{relative} is not in {', '.join(str(c.parent) for c in candidates) or 'any folder'}")
