"""Components of plugin modules that are not installed (a plugin under development, a test's own), registered
for a check here and in the fresh process."""
from __future__ import annotations

import importlib
from pathlib import Path


def register_plugin(module) -> list:
    """Register the components of a plugin module (``@zoo.hookimpl register_*`` functions) that is not installed
    through an entry point; returns the new registry entries (``unregister`` takes them out again). Components
    already registered from this module are left as they are."""
    from zoo.components.registry import KINDS, Registered, registry

    module = importlib.import_module(module) if isinstance(module, str) else module
    entries = []
    for hook, kind in KINDS.items():
        fn = getattr(module, hook, None)
        if callable(fn):
            fn(register=lambda obj, kind=kind: entries.append(
                Registered(kind, obj.name, obj, module.__name__, module.__name__.split(".")[0],
                           str(getattr(module, "__version__", "0+local")))))
    entries = [e for e in entries if getattr(registry.find(e.kind, e.name), "obj", None) is not e.obj]
    registry.add_all(entries)
    for e in entries:
        if e.kind == "architecture":
            e.obj.register_auto_classes()
    return entries


def unregister(entries) -> None:
    from zoo.components.registry import registry

    for e in entries:
        registry.by_kind[e.kind].pop(e.name, None)


def module_root(name: str) -> str:
    """The sys.path folder from which module ``name`` is imported."""
    module = importlib.import_module(name)
    root = Path(module.__file__).resolve().parent
    if Path(module.__file__).name == "__init__.py":
        root = root.parent
    for _ in range(name.count(".")):
        root = root.parent
    return str(root)
