"""Plugin loading (llm style): first-party plugins by dotted path, third-party ones by entry point.

Nothing loads at ``import zoo``. The registry (``zoo.components.registry``) runs ``load_plugins`` before its first lookup,
and so does transformers' first lookup of a model type it does not ship, e.g. ``zoo_<family>``
(``auto_classes_at_first_need``): the ``zoo_<family>`` model types, plugin architectures' included, join the Auto
classes just before ``AutoConfig`` / ``AutoModelForCausalLM.from_pretrained`` needs them. ``moe-zoo`` imports the
plugins (cheap: a plugin's ``__init__`` imports its components inside its hooks) and runs only their
``register_commands`` hooks (``commands_hook``), so ``moe-zoo --help`` lists plugin commands without torch.

Plugins cannot take the zoo down: every import, hook call and registration of a plugin is isolated. A failure
(``SystemExit`` included) is recorded in ``errors`` as one line, reported by ``plugin_report`` / ``moe-zoo
plugins``, and the other plugins still load. Names are first come, first served, and the zoo's own plugins
always come first: a later plugin's clashing component, model or command is refused and reported as its error.

``MOE_ZOO_LOAD_PLUGINS``: unset = all entry points; a comma list = only those (by entry-point or
distribution name; unknown names are warned about); empty string = no third-party plugins.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.metadata as md
import os
import re
import sys
import threading
import traceback
import warnings

import pluggy

from zoo import hookspecs
from zoo.components.registry import KINDS, Registered, registry

DEFAULT_PLUGINS = (
    "zoo.architectures",
    "zoo.components.model_entries",
    "zoo_routers",
    "zoo_compressors",
    "zoo_adapters",
    "zoo_multimodal",
)
OWN = "moe-zoo"  # the zoo's own distribution

pm = pluggy.PluginManager("moe_zoo")
pm.add_hookspecs(hookspecs)
errors: dict[str, str] = {}  # plugin name -> one-line error summary ("; "-joined when several)
_tracebacks: dict[str, str] = {}  # plugin name -> short traceback of its last failure, for debugging
_meta: dict[str, dict] = {}  # plugin name -> {"distribution", "version"}
_lock = threading.RLock()
_loaded = False
_imported = False  # the plugin modules are imported (``import_plugins``); their hooks may not have run yet
_called: set[str] = set()  # plugins whose register_* hooks have run
_auto_done: set[str] = set()  # architectures whose Auto classes are registered
_FAILED = object()


def _record(plugin: str, line: str, tb: str = "") -> None:
    if line in errors.get(plugin, ""):
        return  # e.g. the same command clash on a second ``commands_hook`` call
    errors[plugin] = f"{errors[plugin]}; {line}" if plugin in errors else line
    if tb:
        _tracebacks[plugin] = tb


def _guarded(plugin: str, where: str, fn, *args, **kwargs):
    """``fn(...)``'s result, or ``_FAILED`` after recording what it raised as ``plugin``'s error."""
    try:
        with contextlib.redirect_stdout(sys.stderr):  # keep stdout clean: `moe-zoo plugins` prints JSON there
            return fn(*args, **kwargs)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # SystemExit too: a plugin must never end the zoo (or `moe-zoo plugins`)
        msg = " ".join(str(exc).split())  # one line for users; the traceback keeps the details
        msg = msg if len(msg) <= 300 else msg[:297] + "..."
        _record(plugin, f"{where}: {type(exc).__name__}" + (f": {msg}" if msg else ""),
                traceback.format_exc(limit=-3))
        return _FAILED


def _canonical(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _selected_entry_points():
    wanted = os.environ.get("MOE_ZOO_LOAD_PLUGINS")
    eps = list(md.entry_points(group="moe_zoo"))
    if wanted is None:
        return eps
    names = {w.strip() for w in wanted.split(",") if w.strip()}
    dists = {_canonical(n) for n in names}
    known = {ep.name for ep in eps} | {_canonical(ep.dist.name) for ep in eps if ep.dist}
    unknown = sorted(n for n in names if n not in known and _canonical(n) not in known)
    if unknown:
        warnings.warn(f"MOE_ZOO_LOAD_PLUGINS: no installed plugin is named {', '.join(map(repr, unknown))}; "
                      f"installed entry points: {', '.join(sorted(ep.name for ep in eps)) or 'none'}", stacklevel=2)
    return [ep for ep in eps if ep.name in names or (ep.dist and _canonical(ep.dist.name) in dists)]


def _register(name: str, load) -> None:
    """Import one plugin and register it with pluggy; a failure is recorded as its error."""
    module = _guarded(name, "import", load)
    if module is not _FAILED and _guarded(name, "import", pm.register, module, name=name) is not _FAILED:
        _check_hook_names(name, module)


def _check_hook_names(plugin: str, module) -> None:
    """A hook implementation whose name is no hook (``register_compresors``) would never be called: report it."""
    from zoo.components.options import suggest

    specs = [n for n in dir(hookspecs) if getattr(getattr(hookspecs, n), "moe_zoo_spec", None) is not None]
    for attr in dir(module):
        opts = getattr(getattr(module, attr, None), "moe_zoo_impl", None)
        name = (opts or {}).get("specname") or attr
        if opts is not None and name not in specs:
            _record(plugin, f"unknown hook {name!r} is never called{suggest(name, specs)}")


def _import_plugins() -> None:
    """Import and register the plugins, the zoo's own first."""
    version = _own_version()
    for dotted in DEFAULT_PLUGINS:
        if not (pm.has_plugin(dotted) or dotted in errors):
            _meta[dotted] = {"distribution": OWN, "version": version}
            _register(dotted, lambda d=dotted: importlib.import_module(d))
    for ep in _selected_entry_points():
        dist, version = (ep.dist.name, ep.dist.version) if ep.dist else ("?", "?")
        name, owner = ep.name, _meta.get(ep.name, {}).get("distribution")
        if owner is not None and owner != dist:  # the name is another distribution's (or a first-party plugin's)
            name = f"{dist}:{ep.name}"
            if name not in errors:
                _meta[name] = {"distribution": dist, "version": version}
                _record(name, f"entry point {ep.name!r} is already the name of a plugin of {owner}; not loaded")
            continue
        if not (pm.has_plugin(name) or name in errors):
            _meta[name] = {"distribution": dist, "version": version}
            _register(name, ep.load)


def _call_hooks(plugin_name: str) -> None:
    """Run one plugin's register_* hooks; add its components all at once, or report and add none."""
    entries: list[Registered] = []
    meta = _meta.get(plugin_name, {})
    dist, version = meta.get("distribution", "?"), meta.get("version", "?")

    def register_as(kind):
        def register(obj):
            name = getattr(obj, "name", "")
            if not isinstance(name, str) or not name or name != name.lower() or " " in name:
                raise ValueError(f"{kind} {obj!r} needs a lowercase, dash-separated `name`")
            entries.append(Registered(kind, name, obj, plugin_name, dist, version))
        return register

    for hook, kind in KINDS.items():
        for impl in getattr(pm.hook, hook).get_hookimpls():
            if impl.plugin_name == plugin_name and _guarded(plugin_name, hook, impl.function,
                                                            register=register_as(kind)) is _FAILED:
                return
    _guarded(plugin_name, "registration", registry.add_all, entries)


def import_plugins() -> None:
    """Import every plugin and register it with pluggy, without running its hooks (once per load: what
    ``moe-zoo``'s command list needs; ``load_plugins`` runs the hooks)."""
    global _imported
    with _lock:
        if not _imported:
            _imported = True
            _import_plugins()


def load_plugins() -> None:
    """Import every plugin and run its register_* hooks (once; the registry calls this before its first lookup).
    The zoo's own plugins register first, so a third-party name can never take one of theirs."""
    global _loaded
    with _lock:
        if _loaded:
            return
        _loaded = True  # first: a plugin that looks something up while registering sees what is in so far
        import_plugins()
        names = [n for n, _ in pm.list_name_plugin() if n not in _called]
        names.sort(key=lambda n: _meta.get(n, {}).get("distribution") != OWN)
        for name in names:
            _called.add(name)
            _call_hooks(name)
        for reg in registry.all("architecture"):
            if reg.name in _auto_done:
                continue
            _auto_done.add(reg.name)
            if _guarded(reg.plugin, f"architecture {reg.name!r}", reg.obj.register_auto_classes) is _FAILED:
                del registry.entries["architecture"][reg.name]  # half-registered: unusable


registry.loader = load_plugins


def _importing(roots) -> bool:
    """Whether a module under one of the top-level packages ``roots`` is mid-import right now."""
    return any(name.split(".")[0] in roots and getattr(getattr(module, "__spec__", None), "_initializing", False)
               for name, module in list(sys.modules.items()))


def _plugin_importing() -> bool:
    """Whether a plugin package (not the zoo's own modules) is mid-import: e.g. it imported zoo."""
    roots = {*(d.split(".")[0] for d in DEFAULT_PLUGINS),
             *(ep.module.split(".")[0] for ep in md.entry_points(group="moe_zoo"))}
    return _importing(roots - {"zoo"})


def load_unless_a_plugin_is_importing() -> None:
    """``load_plugins()``, unless a module of a plugin is mid-import right now (its hooks are not defined yet:
    loading waits for the next lookup)."""
    if not _plugin_importing():
        load_plugins()


def load_new_plugins() -> None:
    """Load the plugins installed since the last load (e.g. an entry point added in this process)."""
    global _loaded, _imported
    with _lock:
        _loaded = _imported = False
        load_plugins()


# ---- transformers' Auto classes at first need ------------------------------------------------------------------
# ``import zoo`` must not import transformers (seconds), yet ``AutoModelForCausalLM.from_pretrained(zoo_folder)``
# must find the zoo_<family> model types. transformers resolves every model type through one mapping,
# ``configuration_auto.CONFIG_MAPPING``: once that module has run (now, or later through the import hook below),
# the mapping is armed; its first lookup of a model type transformers does not ship (``zoo_<family>``, or a native
# type a plugin architecture registers), or a listing of them all, loads the plugins, which registers every
# architecture's Auto classes, and disarms it. transformers' own types pass through untouched. Registering right
# when configuration_auto runs could not work: it is imported half-way through transformers.modeling_utils, which
# the family modules need themselves.

_AUTO_CONFIG = "transformers.models.auto.configuration_auto"
_armed_classes: dict[type, type] = {}


def _disarm_and_load(mapping) -> bool:
    """Load the plugins for transformers (the mapping is back to its own class first), unless a transformers or
    plugin module is mid-import (the next lookup tries again). Whether it disarmed."""
    if _importing({"transformers"}) or _plugin_importing():
        return False
    for own, armed in _armed_classes.items():
        if type(mapping) is armed:
            mapping.__class__ = own
    load_plugins()
    return True


def _armed_class(own: type) -> type:
    if own not in _armed_classes:
        def lookup(method):
            def wrapper(self, *args):
                if not args or args[0] not in getattr(self, "_mapping", ()) and args[0] not in self._extra_content:
                    _disarm_and_load(self)  # a listing, or a model type transformers lacks: maybe a plugin's
                return getattr(own, method)(self, *args)
            wrapper.__name__ = method
            return wrapper

        methods = ("__getitem__", "__contains__", "keys", "values", "items", "__iter__", "__reduce__")
        _armed_classes[own] = type(own.__name__, (own,), {
            "__module__": own.__module__, **{m: lookup(m) for m in methods if hasattr(own, m)}})
    return _armed_classes[own]


def _arm(configuration_auto) -> None:
    mapping = getattr(configuration_auto, "CONFIG_MAPPING", None)
    if mapping is None or _loaded or type(mapping) in _armed_classes.values():
        return
    try:
        mapping.__class__ = _armed_class(type(mapping))
    except TypeError:  # a mapping of another layout (another transformers): register at once instead
        load_unless_a_plugin_is_importing()


_AUTO_PROCESSING = "transformers.models.auto.processing_auto"


def _arm_processing(processing_auto) -> None:
    """``AutoProcessor`` finds a processor by the class name its folder's processor config gives, without a
    model-type lookup: when the name is not one transformers knows, load the plugins (they register theirs) and
    look again."""
    own = getattr(processing_auto, "processor_class_from_name", None)
    if own is None or getattr(own, "armed_by_zoo", False):
        return

    def processor_class_from_name(class_name):
        found = own(class_name)
        if found is None and not _loaded and not _importing({"transformers"}) and not _plugin_importing():
            load_plugins()
            found = own(class_name)
        return found

    processor_class_from_name.armed_by_zoo = True
    processing_auto.processor_class_from_name = processor_class_from_name


def _arm_peft(module) -> None:
    """PEFT's MoE name tables: the zoo model types join them when PEFT first imports them."""
    from zoo.architectures import peft_names

    peft_names.register_pending(module)


_ARM = {_AUTO_CONFIG: _arm, _AUTO_PROCESSING: _arm_processing,
        "peft.utils.transformers_weight_conversion": _arm_peft}


class _ArmAfterImport:
    """A ``sys.meta_path`` finder that arms ``CONFIG_MAPPING`` (and AutoProcessor's class lookup) right after
    their modules run."""

    def find_spec(self, fullname, path=None, target=None):
        arm = _ARM.get(fullname)
        if arm is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is not None and hasattr(loader, "exec_module"):
            run = loader.exec_module

            def exec_module(module):
                run(module)
                arm(module)

            try:
                loader.exec_module = exec_module  # this module's loader only
            except AttributeError:
                pass
        return spec

    def invalidate_caches(self):
        pass


def auto_classes_at_first_need() -> None:
    """What ``import zoo`` runs: arm transformers' config mapping now if configuration_auto has run, and install
    the hook that arms it when it does (cheap: imports nothing)."""
    with _lock:
        if not any(isinstance(f, _ArmAfterImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _ArmAfterImport())
        for name, arm in _ARM.items():
            if name in sys.modules:
                arm(sys.modules[name])


@contextlib.contextmanager
def restored_state():
    """Everything the loader and the registry hold is put back on exit: the plugins, components and errors of
    plugins loaded inside are forgotten (tests that install plugins use it). Model types a plugin registered with
    transformers' Auto classes stay registered."""
    load_plugins()
    plugins = {n for n, _ in pm.list_name_plugin()}
    entries = {kind: dict(by_name) for kind, by_name in registry.entries.items()}
    saved = [(d, dict(d)) for d in (errors, _tracebacks, _meta)] + [(s, set(s)) for s in (_called, _auto_done)]
    try:
        yield
    finally:
        with _lock:
            for name, _ in pm.list_name_plugin():
                if name not in plugins:
                    pm.unregister(name=name)
            for kind, by_name in registry.entries.items():
                by_name.clear()
                by_name.update(entries.get(kind, {}))
            for container, before in saved:
                container.clear()
                container.update(before)


def provenance(kind: str, name: str) -> dict | None:
    """``{"distribution", "version"}`` of the plugin that registered a component, for what a model records."""
    reg = registry.find(kind, name)
    return None if reg is None else reg.provenance


def commands_hook(cli) -> None:
    """Add the plugins' commands to the click group ``cli``. A plugin may not replace a built-in command or
    another plugin's (the first registered wins): such a command is refused and reported as its error."""
    import click

    import_plugins()  # their modules only (cheap): pluggy's hook callers fill as plugins register
    # plugin -> its added commands, kept on the group so a second call adds nothing twice
    added: dict[str, list[str]] = cli.__dict__.setdefault("_zoo_plugin_commands", {})
    order = {n: i for i, (n, _) in enumerate(pm.list_name_plugin())}
    impls = sorted(pm.hook.register_commands.get_hookimpls(), key=lambda i: order.get(i.plugin_name, len(order)))
    for impl in impls:
        plugin = impl.plugin_name
        if plugin in added:
            continue
        added[plugin] = []
        staging = click.Group(cli.name)  # the plugin adds to this; its commands are then vetted one by one
        if _guarded(plugin, "register_commands", impl.function, cli=staging) is _FAILED:
            continue
        for name, command in staging.commands.items():
            owner = next((p for p, names in added.items() if name in names), None)
            if owner is not None:
                _record(plugin, f"register_commands: command {name!r} is already added by plugin {owner!r}; "
                                "not added")
            elif name in cli.commands:
                _record(plugin, f"register_commands: command {name!r} would replace the built-in "
                                f"`moe-zoo {name}`; not added")
            else:
                cli.add_command(command, name)
                added[plugin].append(name)


def plugin_report(include_defaults: bool = False) -> list[dict]:
    """What ``moe-zoo plugins`` prints: name, version, hooks, components, and any error (one line; the
    ``traceback`` field has the details of an exception)."""
    load_plugins()
    out = []
    for name in sorted(set(_meta) | set(errors)):
        meta = _meta.get(name, {"distribution": OWN if name in DEFAULT_PLUGINS else "?", "version": "?"})
        if meta["distribution"] == OWN and not include_defaults and name not in errors:
            continue
        plugin = pm.get_plugin(name)
        hooks = sorted(c.name for c in pm.get_hookcallers(plugin)) if plugin is not None else []
        comps = [f"{e.kind}:{e.name}" for e in registry.all() if e.plugin == name]
        row = {"name": name, "distribution": meta["distribution"], "version": meta["version"],
               "hooks": hooks, "components": comps}
        if name in errors:
            row["error"] = errors[name]
            if name in _tracebacks:
                row["traceback"] = _tracebacks[name]
        out.append(row)
    return out


def _own_version() -> str:
    try:
        return md.version(OWN)
    except md.PackageNotFoundError:
        return "0+unknown"
