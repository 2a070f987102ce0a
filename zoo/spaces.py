"""The zoo's Gradio demo Spaces (``spaces/<name>/``): find one, import its app, launch it locally.

Each Space folder holds ``app.py`` (a ``build_demo()`` returning a ``gr.Blocks``), ``requirements.txt`` and
a ``README.md`` with Hugging Face Spaces front matter. A component names the Space that demonstrates it
in its ``space`` attribute; a plugin may ship its own ``spaces/<name>/`` beside its module or at the top of
its package, where that component's Space is looked for first (``find_space``: ``moe-zoo demo NAME`` takes a
Space or a component name).

The Spaces are meant to be public, so every input is bounded before any work starts (limits below,
documented in ``spaces/README.md``): text is cut or refused by length, numbers by range, uploads by size.
"""
from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path
from types import ModuleType

from zoo.options import suggest
from zoo.resources import package_dirs, resource_path

MAX_FILE_SIZE = "5mb"  # any upload (a drawn or photographed digit, a spoken digit)
MAX_PROMPT_CHARS = 2000  # free text: cut to this many characters before tokenising
MAX_OPTIONS_CHARS = 200  # an adapter's "k=v,..." options
MAX_OPTION_VALUE = 256  # any number in those options (r, alpha, num_experts, top_k, ...), in absolute value
MAX_AUDIO_SECONDS = 10
MAX_IMAGE_PIXELS = 4096 * 4096


class UnknownSpace(KeyError, ValueError):
    def __str__(self):
        return self.args[0]


def list_spaces() -> list[str]:
    """Names of the Spaces shipped with the zoo (folders with an ``app.py``)."""
    return _spaces_in(resource_path("spaces"))


def _spaces_in(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if (p / "app.py").is_file()) if root.is_dir() else []


def owner_spaces(owner: object) -> dict[str, Path]:
    """``{space: folder}`` of the Spaces a component's own package ships (nearest folder first)."""
    found: dict[str, Path] = {}
    for folder in package_dirs(owner):
        for name in _spaces_in(folder / "spaces"):
            found.setdefault(name, folder / "spaces" / name)
    return found


def space_dir(name: str, owner: object | None = None) -> Path:
    """The folder of Space ``name``: in ``owner``'s own package first (see ``package_dirs``), then the zoo's.

    ``name`` must be one of the folder names found there (``list_spaces()``, plus the owner's own): a
    path (``../x``, ``/x``, ``a/b``) is refused, never resolved."""
    own = owner_spaces(owner) if owner is not None else {}
    if isinstance(name, str) and name in own:
        return own[name]
    known = sorted(set(list_spaces()) | set(own))
    path = resource_path(f"spaces/{name}") if isinstance(name, str) and name in known else None
    if path is None or not (path / "app.py").is_file():
        raise UnknownSpace(f"no Space named {name!r}{suggest(str(name), known)} (Spaces: {', '.join(known)})")
    return path


def find_space(name: str) -> tuple[str, object | None]:
    """``(space, owner)`` for ``moe-zoo demo NAME``, NAME being a Space or a component: one of the zoo's Spaces;
    else a registered component, whose ``space`` is looked for in its own package first, then in the zoo's;
    else a Space that a plugin's package ships. An unknown NAME gets close matches."""
    from zoo.registry import registry

    if name in list_spaces():
        return name, None
    components = [r for r in registry.all() if r.kind != "model"]
    for reg in components:
        if reg.name == name:
            space = getattr(reg.obj, "space", "") or ""
            if not space:
                raise UnknownSpace(f"{reg.kind} {name!r} names no Space (its `space` attribute is empty)")
            if space not in owner_spaces(reg.obj) and space not in list_spaces():
                where = ", ".join(str(d / "spaces") for d in package_dirs(reg.obj)) or "its package"
                raise UnknownSpace(f"{reg.kind} {name!r} names the Space {space!r}, which is neither in {where} "
                                   f"nor among the zoo's Spaces ({', '.join(list_spaces())})")
            return space, reg.obj
    shipped = [(space, reg.obj) for reg in components for space in owner_spaces(reg.obj)]
    owners = [obj for space, obj in shipped if space == name]
    if owners:  # a component that names the Space before one whose package merely ships it
        return name, next((obj for obj in owners if getattr(obj, "space", "") == name), owners[0])
    spaces = sorted(set(list_spaces()) | {space for space, _ in shipped})
    named = sorted(r.name for r in components if getattr(r.obj, "space", ""))
    raise UnknownSpace(f"no Space named {name!r}{suggest(str(name), spaces + named)} (Spaces: {', '.join(spaces)}; "
                       "or the name of a component, for the Space that shows it)")


def load_app(name: str, owner: object | None = None) -> ModuleType:
    """Import the Space's ``app.py`` as a fresh module (its models load lazily, on first use)."""
    path = space_dir(name, owner) / "app.py"
    module_name = f"zoo_space_{name.replace('-', '_')}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


def launch(name: str, port: int | None = None, **launch_kwargs):
    """Build Space ``name`` (a Space, or a component whose Space it is: see ``find_space``) and serve it on
    127.0.0.1 (never shared, no analytics, uploads up to ``MAX_FILE_SIZE``); blocks until stopped unless
    ``prevent_thread_lock=True`` is passed, in which case the running ``gr.Blocks`` is returned."""
    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
    space, owner = find_space(name)
    demo = load_app(space, owner).build_demo()
    demo.analytics_enabled = False
    launch_kwargs.setdefault("max_file_size", MAX_FILE_SIZE)
    demo.launch(server_name="127.0.0.1", server_port=port, share=False, **launch_kwargs)
    return demo


# ---- input limits, for the Spaces' handlers --------------------------------------------------------------

def _error(message: str) -> Exception:
    import gradio as gr

    return gr.Error(message)


def cut_text(text: str | None, limit: int = MAX_PROMPT_CHARS) -> str:
    """The first ``limit`` characters of ``text`` (for inputs of which only a prefix is used anyway)."""
    return (text or "")[:limit]


def check_text(text: str | None, label: str, limit: int) -> str:
    """``text``, or a ``gr.Error`` if it is longer than ``limit`` characters."""
    text = text or ""
    if len(text) > limit:
        raise _error(f"{label} is too long: {len(text):,} characters, at most {limit:,}.")
    return text


def check_number(value, label: str, low: float, high: float) -> float:
    """``value`` as a float, or a ``gr.Error`` unless it is a finite number in [low, high]."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        number = math.nan
    if not (math.isfinite(number) and low <= number <= high):
        shown = repr(value) if len(repr(value)) <= 24 else repr(value)[:20] + "..."
        raise _error(f"{label} must be a number from {low:g} to {high:g}; got {shown}.")
    return number


def check_options(options: dict, label: str = "options", limit: float = MAX_OPTION_VALUE) -> dict:
    """``options``, or a ``gr.Error`` if any number in them (lists included) is beyond ``limit`` in absolute value."""
    def numbers(value):
        if isinstance(value, (list, tuple)):
            for item in value:
                yield from numbers(item)
        elif isinstance(value, dict):
            for item in value.values():
                yield from numbers(item)
        elif isinstance(value, (int, float)):
            yield value

    for key, value in options.items():
        for number in numbers(value):
            check_number(number, f"{label}: {key}", -limit, limit)
    return options


def check_audio(rate: int, samples, label: str = "audio", limit: float = MAX_AUDIO_SECONDS) -> None:
    """A ``gr.Error`` if the clip is longer than ``limit`` seconds."""
    seconds = len(samples) / rate if rate and rate > 0 else math.inf
    if seconds > limit:
        raise _error(f"{label} is too long: {seconds:.1f} s, at most {limit:g} s.")
