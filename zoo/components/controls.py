"""Demo controls: how a component tells a Space which of its options to show, in what range, and with what
"mild" and "strong" settings.

The contract (classmethods on the component class; the bases ``Router``, ``Experts``, ``Compressor`` and
``Adapter`` give the defaults, so a component that declares nothing still gets controls):

- ``demo_controls(model=None) -> list[Control]``: the options a Space shows. The default builds them from the
  ``__init__`` signature (``zoo.components.options.describe_options``): a number, a switch or a text box per option with a
  simple default. ``model`` is the model the Space shows, or None when the page is built (the model loads
  later): a range may depend on it (``num_experts`` up to the layer's expert count).
- ``demo_presets(model=None) -> {"mild": {...}, "strong": {...}}``: options for the two strengths; the default
  is the controls' defaults for both.
- ``demo_unfit(model) -> str``: "" if the component can run on ``model``, else why not (the Space shows the
  reason instead of a result).

A preset or a control's default must be options the component itself accepts (``zoo.apply`` does not refuse
them); ``tests/test_space_components.py`` checks that for every first-party component.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from zoo.components.options import describe_options

PRESETS = ("mild", "strong")
KINDS = ("int", "float", "bool", "choice", "text", "json")


@dataclass(frozen=True)
class Control:
    """One option of a component as a Space shows it.

    ``kind``: "int" or "float" (a slider from ``low`` to ``high`` by ``step``, or a number box without both
    bounds), "bool" (a checkbox), "choice" (a dropdown of ``choices``), "text" (a string), "json" (a JSON value
    typed as text: a list or a mapping). ``optional``: None is a valid value (an empty box means None)."""

    name: str
    kind: str
    default: Any = None
    low: float | None = None
    high: float | None = None
    step: float | None = None
    choices: tuple = ()
    optional: bool = False
    help: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"control {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "choice" and not self.choices:
            raise ValueError(f"control {self.name!r}: a choice needs its choices")

    @property
    def label(self) -> str:
        return self.name + (f": {self.help}" if self.help else "")

    def with_range(self, low=None, high=None, default=None) -> "Control":
        """The same control with a narrower range (``None`` keeps a bound), its default clamped into it."""
        low = self.low if low is None else low
        high = self.high if high is None else high
        value = self.default if default is None else default
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = min(max(value, low if low is not None else value), high if high is not None else value)
        return replace(self, low=low, high=high, default=value)

    def parse(self, value):
        """A widget's value -> the option value (ints as ints, "" -> None where optional, JSON text parsed)."""
        if value is None or (isinstance(value, str) and not value.strip() and self.kind in ("json", "int", "float")):
            if self.optional:
                return None
            raise ValueError(f"{self.name} needs a value")
        if self.kind == "int":
            number = float(value)
            if number != int(number):
                raise ValueError(f"{self.name} must be a whole number, got {value!r}")
            return int(number)
        if self.kind == "float":
            return float(value)
        if self.kind == "bool":
            return bool(value)
        if self.kind == "json":
            if isinstance(value, str):
                try:
                    return json.loads(value)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{self.name} must be JSON: {exc}") from None
            return value
        return value

    def show(self, value):
        """An option value -> what the widget shows (JSON as text, None as an empty box where optional)."""
        if self.kind == "json":
            return "" if value is None else json.dumps(value)
        return value


def moe_blocks(model) -> list:
    """The MoE blocks of ``model``: modules whose class says it is one (``zoo_moe_block``, set by ``SparseMoE``).
    Read by that mark, not by importing the MoE core, which declares its own controls through this module."""
    return [] if model is None else [m for m in model.modules() if getattr(type(m), "zoo_moe_block", False)]


def layer_experts(model) -> int | None:
    """The fewest experts of any MoE layer of ``model`` (None without a model or MoE layers)."""
    counts = [moe.num_experts for moe in moe_blocks(model)]
    return min(counts) if counts else None


def layer_top_k(model) -> int | None:
    """The largest k of any MoE layer of ``model`` (None without a model or MoE layers)."""
    ks = [moe.top_k for moe in moe_blocks(model)]
    return max(ks) if ks else None


def expert_fraction(model, fraction: float, fallback: int) -> int:
    """``fraction`` of the layer's experts (at least 1, fewer than all), or ``fallback`` without a model."""
    n = layer_experts(model)
    return fallback if n is None else max(1, min(n - 1, round(n * fraction)))


def num_experts_control(model, help: str = "experts kept per layer") -> Control:
    """The usual ``num_experts`` control of a pruner or merger: 1 to the layer's experts - 1."""
    n = layer_experts(model)
    return Control("num_experts", "int", expert_fraction(model, 0.75, 6), low=1, high=(n - 1) if n else 64,
                   step=1, help=help)


def controls_from_signature(cls, skip=(), model=None) -> list[Control]:
    """Controls for the ``__init__`` options of ``cls`` (``describe_options``) whose type is simple: an int,
    float, bool or str option with a default becomes a box of that kind; an option without a default only if it
    is ``num_experts`` (3/4 of the layer's experts); anything else (lists, mappings) a JSON text box."""
    out = []
    for option in describe_options(cls, skip=skip):
        name, kind, default = option["name"], option["type"].replace(" ", ""), option["default"]
        optional = "None" in kind.split("|")
        kind = next((k for k in kind.split("|") if k != "None"), "")
        if option["required"]:
            if name == "num_experts":
                out.append(num_experts_control(model))
            continue
        if isinstance(default, bool) or kind == "bool":
            out.append(Control(name, "bool", bool(default), help=option["help"]))
        elif kind in ("int", "float") or (isinstance(default, (int, float)) and not kind):
            out.append(Control(name, kind or type(default).__name__, default, optional=optional or default is None,
                               help=option["help"]))
        elif kind == "str" or isinstance(default, str):
            out.append(Control(name, "text", default or "", help=option["help"]))
        else:
            out.append(Control(name, "json", list(default) if isinstance(default, tuple) else default,
                               optional=True, help=option["help"]))
    return out


def controls_for(cls, model=None) -> list[Control]:
    """``cls.demo_controls(model)``, or controls from its signature for a class without the method."""
    method = getattr(cls, "demo_controls", None)
    if method is not None:
        return list(method(model))
    skip = ("hidden_size", "num_experts", "top_k") if getattr(cls, "target", "") else ()
    return controls_from_signature(cls, skip, model)


def defaults_of(controls: list[Control]) -> dict:
    """``{name: default}`` of the controls, leaving out optional ones whose default is None."""
    return {c.name: c.default for c in controls if not (c.optional and c.default is None)}


def presets_for(cls, model=None) -> dict[str, dict]:
    """``cls.demo_presets(model)`` (every strength in ``PRESETS``), or the controls' defaults for each."""
    method = getattr(cls, "demo_presets", None)
    presets = dict(method(model)) if method is not None else {}
    defaults = defaults_of(controls_for(cls, model))
    return {strength: dict(presets.get(strength, defaults)) for strength in PRESETS}


def unfit_reason(cls, model) -> str:
    """Why ``cls`` cannot run on ``model`` ("" if it can): ``cls.demo_unfit(model)`` where the class has it."""
    method = getattr(cls, "demo_unfit", None)
    return (method(model) or "") if method is not None and model is not None else ""


class DemoControls:
    """The defaults the component bases inherit (``Router``, ``Experts``, ``Compressor``, ``Adapter``)."""

    demo_skip: tuple[str, ...] = ()  # __init__ parameters that are no option (a router's hidden_size, ...)

    @classmethod
    def demo_controls(cls, model=None) -> list[Control]:
        return controls_from_signature(cls, cls.demo_skip, model)

    @classmethod
    def demo_presets(cls, model=None) -> dict[str, dict]:
        defaults = defaults_of(cls.demo_controls(model))
        return {strength: dict(defaults) for strength in PRESETS}

    @classmethod
    def demo_unfit(cls, model) -> str:
        return ""


__all__ = ["Control", "DemoControls", "PRESETS", "controls_for", "controls_from_signature", "defaults_of",
           "expert_fraction", "layer_experts", "layer_top_k", "num_experts_control", "presets_for",
           "unfit_reason"]
