"""Plugin loading (llm style): first-party plugins by dotted path, third-party ones by entry point.

A plugin that fails to import or to register is recorded in ``errors`` and the others still load.
``MOE_ZOO_LOAD_PLUGINS``: unset = all entry points; a comma list = only those (by entry-point or
distribution name); empty string = no third-party plugins.
"""
from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import threading
import traceback

import pluggy

from zoo import hookspecs
from zoo.components import KINDS, Registered, Registry

DEFAULT_PLUGINS = (
    "zoo.architectures",
    "zoo.model_entries",
    "zoo_routers",
    "zoo_compressors",
    "zoo_adapters",
    "zoo_multimodal",
)

pm = pluggy.PluginManager("moe_zoo")
pm.add_hookspecs(hookspecs)
registry = Registry()
errors: dict[str, str] = {}  # plugin name -> error text
_meta: dict[str, dict] = {}  # plugin name -> {"distribution", "version"}
_lock = threading.RLock()
_loaded = False
_called: set[str] = set()  # plugins whose register_* hooks have run


def _selected_entry_points():
    wanted = os.environ.get("MOE_ZOO_LOAD_PLUGINS")
    eps = md.entry_points(group="moe_zoo")
    if wanted is None:
        return list(eps)
    names = {w.strip() for w in wanted.split(",") if w.strip()}
    return [ep for ep in eps if ep.name in names or (ep.dist and ep.dist.name in names)]


def _register_module(name: str, module, distribution: str, version: str) -> None:
    pm.register(module, name=name)
    _meta[name] = {"distribution": distribution, "version": version}


def _initializing(module) -> bool:
    """True while the module is still being imported, e.g. ``import zoo_routers`` imported zoo first."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _import_plugins() -> bool:
    """Import and register the plugins; False if a first-party one is mid-import and must wait."""
    version = _own_version()
    complete = True
    for dotted in DEFAULT_PLUGINS:
        if pm.has_plugin(dotted) or dotted in errors:
            continue
        try:
            module = importlib.import_module(dotted)
            if _initializing(module):  # its hooks are not defined yet: register it on the next call
                complete = False
                continue
            _register_module(dotted, module, "moe-zoo", version)
        except Exception:
            errors[dotted] = traceback.format_exc(limit=3)
    for ep in _selected_entry_points():
        if pm.has_plugin(ep.name) or ep.name in errors:
            continue
        dist = ep.dist.name if ep.dist else "?"
        try:
            _register_module(ep.name, ep.load(), dist, ep.dist.version if ep.dist else "?")
        except Exception:
            errors[ep.name] = traceback.format_exc(limit=3)
            _meta[ep.name] = {"distribution": dist, "version": ep.dist.version if ep.dist else "?"}
    return complete


def _call_hooks(plugin_name: str) -> None:
    """Run one plugin's register_* hooks; add its components all at once, or report and add none."""
    entries: list[Registered] = []
    dist = _meta[plugin_name]["distribution"]
    for hook, kind in KINDS.items():

        def register(obj, _kind=kind):
            name = getattr(obj, "name", "")
            if not name or name != name.lower() or " " in name:
                raise ValueError(f"{_kind} {obj!r} needs a lowercase, dash-separated `name`")
            entries.append(Registered(_kind, name, obj, plugin_name, dist))

        for impl in getattr(pm.hook, hook).get_hookimpls():
            if impl.plugin_name == plugin_name:
                impl.function(register=register)
    registry.add_all(entries)


def load_plugins() -> None:
    global _loaded
    with _lock:
        if _loaded:
            return
        _loaded = _import_plugins()
        for name, _plugin in list(pm.list_name_plugin()):
            if name in _called:
                continue
            _called.add(name)
            try:
                _call_hooks(name)
            except Exception as exc:
                errors[name] = f"{type(exc).__name__}: {exc}"
        for reg in registry.all("architecture"):
            reg.obj.register_auto_classes()


def commands_hook(cli) -> None:
    load_plugins()
    for impl in pm.hook.register_commands.get_hookimpls():
        try:
            impl.function(cli=cli)
        except Exception as exc:
            errors[impl.plugin_name] = f"register_commands: {type(exc).__name__}: {exc}"


def plugin_report(include_defaults: bool = False) -> list[dict]:
    """What ``moe-zoo plugins`` prints: name, version, hooks, components, and any error."""
    load_plugins()
    out = []
    for name in sorted(set(_meta) | set(errors)):
        meta = _meta.get(name, {"distribution": "moe-zoo" if name in DEFAULT_PLUGINS else "?", "version": "?"})
        if meta["distribution"] == "moe-zoo" and not include_defaults and name not in errors:
            continue
        plugin = pm.get_plugin(name)
        hooks = sorted(c.name for c in pm.get_hookcallers(plugin)) if plugin is not None else []
        comps = [f"{e.kind}:{e.name}" for e in registry.all() if e.plugin == name]
        row = {"name": name, "distribution": meta["distribution"], "version": meta["version"],
               "hooks": hooks, "components": comps}
        if name in errors:
            row["error"] = errors[name]
        out.append(row)
    return out


def _own_version() -> str:
    try:
        return md.version("moe-zoo")
    except md.PackageNotFoundError:
        return "0+unknown"
