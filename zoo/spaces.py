"""The zoo's Gradio demo Spaces (``spaces/<name>/``): find one, import its app, launch it locally.

Each Space folder holds ``app.py`` (a ``build_demo()`` returning a ``gr.Blocks``), ``requirements.txt`` and
a ``README.md`` with Hugging Face Spaces front matter. A component names the Space that demonstrates it
in its ``space`` attribute; a third-party plugin may ship its own ``spaces/<name>/`` beside its module.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from zoo.options import suggest
from zoo.resources import resource_path


class UnknownSpace(KeyError, ValueError):
    def __str__(self):
        return self.args[0]


def list_spaces() -> list[str]:
    """Names of the Spaces shipped with the zoo (folders with an ``app.py``)."""
    root = resource_path("spaces")
    return sorted(p.name for p in root.iterdir() if (p / "app.py").is_file())


def space_dir(name: str, owner: object | None = None) -> Path:
    """The folder of Space ``name`` (beside ``owner``'s module first, then the checkout or the package)."""
    try:
        path = resource_path(f"spaces/{name}", owner=owner)
    except FileNotFoundError:
        path = None
    if not name or path is None or not (path / "app.py").is_file():
        known = list_spaces()
        raise UnknownSpace(f"no Space named {name!r}{suggest(name, known)} (Spaces: {', '.join(known)})")
    return path


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
    """Build Space ``name`` and serve it on 127.0.0.1 (never shared, no analytics); blocks until stopped
    unless ``prevent_thread_lock=True`` is passed, in which case the running ``gr.Blocks`` is returned."""
    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
    demo = load_app(name).build_demo()
    demo.analytics_enabled = False
    demo.launch(server_name="127.0.0.1", server_port=port, share=False, **launch_kwargs)
    return demo
