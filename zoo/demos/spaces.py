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

import functools
import importlib.util
import math
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

from zoo.components.options import suggest
from zoo.components.resources import package_dirs, resource_path

MAX_FILE_SIZE = "5mb"  # any upload (a drawn or photographed digit, a spoken digit)
MAX_PROMPT_CHARS = 2000  # free text: cut to this many characters before tokenising
MAX_OPTIONS_CHARS = 200  # an adapter's "k=v,..." options
MAX_OPTION_VALUE = 256  # any number in those options (r, alpha, num_experts, top_k, ...), in absolute value
MAX_AUDIO_SECONDS = 10
MAX_IMAGE_PIXELS = 4096 * 4096


# Gradio runs the handlers of different events in threads at once (a page load's and a click's), and loading a
# model switches torch's global default dtype for a moment: model work in a Space runs one call at a time.
WORK_LOCK = threading.RLock()


def one_at_a_time(fn):
    """``fn`` run under ``WORK_LOCK`` (for a Space's handlers that load or run a model)."""
    @functools.wraps(fn)
    def locked(*args, **kwargs):
        with WORK_LOCK:
            return fn(*args, **kwargs)

    return locked


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
    from zoo.components.registry import registry

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


# ---- controls declared by the components (zoo.components.controls), as gradio widgets ---------------------------

def components_of(kind: str) -> dict[str, type]:
    """``{name: class}`` of every registered component of ``kind`` (plugins' included), in registry order."""
    from zoo.components.registry import registry

    return {c["name"]: registry.get(kind, c["name"]).obj for c in _list_components(kind)}


def _list_components(kind):
    import zoo

    return zoo.list_components(kind)


def _widget(control):
    """The gradio component for one ``zoo.components.controls.Control`` (values are set by ``ControlPanel.select``)."""
    import gradio as gr

    label, value = control.label, control.show(control.default)
    if control.kind == "bool":
        return gr.Checkbox(value=bool(value), label=label)
    if control.kind == "choice":
        return gr.Dropdown(list(control.choices), value=value, label=label)
    if control.kind in ("text", "json"):
        return gr.Textbox(value=value or "", label=label, max_length=MAX_OPTIONS_CHARS,
                          placeholder="empty: none" if control.optional else None)
    bounded = control.low is not None and control.high is not None
    if bounded and not control.optional:
        return gr.Slider(control.low, control.high, value=value, step=control.step or (1 if control.kind == "int" else None),
                         label=label)
    return gr.Number(value=value, label=label + (" (empty: none)" if control.optional else ""), minimum=control.low,
                     maximum=control.high, precision=0 if control.kind == "int" else None)


class ControlPanel:
    """A dropdown of the components of one kind, a mild/strong preset, and each component's declared controls
    (``zoo.components.controls``), shown for the chosen one. ``options`` (a ``gr.JSON``) holds what the Space's action
    should pass to the component: the action takes ``[panel.name, panel.options]`` and calls ``panel.resolve``.

    ``model_for(cls)`` is the model the component would run on (loaded lazily: the first ``select`` loads it);
    ranges and presets that depend on the model are set then."""

    def __init__(self, kind: str, model_for, default: str | None = None, label: str | None = None):
        import gradio as gr

        from zoo.components.controls import PRESETS, controls_for

        self.kind, self.model_for = kind, model_for
        self.classes = components_of(kind)
        names = list(self.classes)
        with gr.Row():
            self.name = gr.Dropdown(names, value=default if default in names else names[0], label=label or kind,
                                    elem_id=f"{kind}-name")
            self.preset = gr.Radio(list(PRESETS), value=PRESETS[0], label="preset", elem_id=f"{kind}-preset")
        self.about = gr.Markdown(elem_id=f"{kind}-about")
        self.groups, self.widgets = {}, {}
        for name, cls in self.classes.items():
            with gr.Group(visible=False) as group:
                self.widgets[name] = [(c, _widget(c)) for c in controls_for(cls)]
            self.groups[name] = group
        self.options = gr.JSON(label="options passed to the component", elem_id=f"{kind}-options")
        self.all_widgets = [w for pairs in self.widgets.values() for _, w in pairs]
        gr.on([w.input for w in self.all_widgets], self.collect, [self.name, *self.all_widgets], self.options,
              api_visibility="private", show_progress="hidden")
        gr.api(self.preset_options, api_name=f"{kind}_preset")

    # -- what the page calls
    def outputs(self) -> list:
        return [self.about, self.options, *self.groups.values(), *self.all_widgets]

    def on_select(self, triggers):
        """Wire ``select`` to ``triggers`` (events such as ``demo.load``, ``panel.name.input``); the dependency
        is returned, for ``.then(action)``."""
        import gradio as gr

        return gr.on(triggers, self.select, [self.name, self.preset], self.outputs(), api_visibility="private")

    @one_at_a_time
    def select(self, name: str, preset: str):
        """The chosen component's group shown, its controls set from the preset (ranges from the model), the
        others hidden and left as they are; the summary, and the reason when it does not fit the model."""
        import gradio as gr

        from zoo.components.controls import controls_for, presets_for, unfit_reason

        cls = self.component(name)
        model = self.model_for(cls)
        controls = controls_for(cls, model)
        values = presets_for(cls, model).get(preset, {})
        unfit = unfit_reason(cls, model)
        about = f"**{name}**: {cls.summary}" + (f"\n\n⚠️ **Does not fit this model.** {unfit}" if unfit else "")
        updates = []
        for other, pairs in self.widgets.items():
            declared = {c.name: c for c in controls} if other == name else {}
            for control, _ in pairs:
                control = declared.get(control.name)
                if control is None:
                    updates.append(gr.update() if other != name else gr.update(visible=False))
                    continue
                value = control.show(values.get(control.name, control.default))
                if control.kind in ("int", "float") and control.low is not None and control.high is not None:
                    updates.append(gr.update(value=value, minimum=control.low, maximum=control.high, visible=True))
                else:
                    updates.append(gr.update(value=value, visible=True))
        groups = [gr.update(visible=other == name) for other in self.groups]
        options = self.preset_options(name, preset) if not unfit else {}
        return [about, options, *groups, *updates]

    def collect(self, name: str, *values) -> dict:
        """The options the chosen component's widgets show (a value that does not parse is left out)."""
        out, i = {}, 0
        for other, pairs in self.widgets.items():
            for control, _ in pairs:
                if other == name:
                    try:
                        value = control.parse(values[i])
                    except (TypeError, ValueError):
                        value = None
                    if value is not None:
                        out[control.name] = value
                i += 1
        return out

    @one_at_a_time
    def preset_options(self, name: str, preset: str) -> dict:
        """The options of ``name``'s preset (mild or strong) on the Space's model."""
        from zoo.components.controls import PRESETS, presets_for

        cls = self.component(name)
        if preset not in PRESETS:
            raise _error(f"preset must be one of {', '.join(PRESETS)}; got {preset!r}")
        return presets_for(cls, self.model_for(cls))[preset]

    def component(self, name: str):
        if name not in self.classes:
            raise _error(f"no {self.kind} named {name!r}{suggest(str(name), self.classes)}")
        return self.classes[name]

    @one_at_a_time
    def resolve(self, name: str, options) -> tuple[type, dict]:
        """``(class, options)`` for an action, after the checks: a known component, options a mapping of at most
        ``MAX_OPTIONS_CHARS`` characters with numbers bounded, and a component that fits the model (else a
        ``gr.Error`` with the component's own reason)."""
        import json

        from zoo.components.controls import unfit_reason

        cls = self.component(name)
        options = {} if options is None else options
        if not isinstance(options, dict):
            raise _error(f"options must be a mapping of option names to values; got {type(options).__name__}")
        check_text(json.dumps(options), "options", MAX_OPTIONS_CHARS)
        check_options(options, name)
        unfit = unfit_reason(cls, self.model_for(cls))
        if unfit:
            raise _error(f"{name} does not fit this model: {unfit}")
        return cls, options


def apply_component(model, name: str, options: dict, **kwargs):
    """``zoo.apply(model, name, **kwargs, **options)``, its refusals (bad option values) as a ``gr.Error``."""
    import zoo

    try:
        return zoo.apply(model, name, **kwargs, **options)
    except (ValueError, TypeError) as exc:
        from zoo.editing.apply import NoChange

        if isinstance(exc, NoChange):
            raise
        raise _error(f"{name} {options}: {exc}") from None


def integer_ticks(ax, axis: str = "both") -> None:
    """Integer tick marks (layers, experts) on a matplotlib axis."""
    from matplotlib.ticker import MaxNLocator

    if axis in ("x", "both"):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if axis in ("y", "both"):
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
