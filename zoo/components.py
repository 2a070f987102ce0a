"""Component base classes and the name -> class registry that plugins fill."""
from __future__ import annotations

from dataclasses import dataclass, field

from zoo.options import check_options, suggest

# hook name -> component kind
KINDS = {
    "register_architectures": "architecture",
    "register_routers": "router",
    "register_experts": "experts",
    "register_adapters": "adapter",
    "register_compressors": "compressor",
    "register_models": "model",
}


class Component:
    """Metadata every component class carries."""

    name: str = ""
    summary: str = ""
    paper: str = ""
    card: str = ""
    space: str = ""

    def __init__(self, **options):
        check_options(type(self), options)
        self.options = options


class Compressor(Component):
    """``compress(model, calibration=None) -> model``. Validate options in ``__init__``.

    A compressor that implements the per-layer contract (``compress_layer``; see ``zoo.layerwise`` and
    docs/plugin-contract.md) gets ``compress`` for free and works on checkpoints streamed from their shards
    too. One that overrides ``compress`` alone works on models in memory only.
    """

    kind = "compressor"
    needs_calibration = False
    inputs_for: tuple[str, ...] = ()  # "observe", "compress": the phases that receive the layer's input tokens
    needs_plan = False  # observe every layer, then plan(), before compress_layer

    @property
    def layerwise(self) -> bool:
        return type(self).compress_layer is not Compressor.compress_layer

    def check_layer(self, index: int, block) -> None:
        """Raise (before anything changes) if layer ``index``'s block cannot be compressed."""

    def observe(self, index: int, block, inputs) -> None:
        """Statistics pass: look at layer ``index`` (``inputs [T, H]`` or None)."""

    def plan(self) -> None:
        """Once, after every layer was observed: decide what the global view decides (a bit budget, a ranking)."""

    def compress_layer(self, index: int, block, inputs):  # pragma: no cover - abstract
        """Return the compressed block of layer ``index`` (a new ``SparseMoE``, or ``block`` unchanged)."""
        raise NotImplementedError

    def compress(self, model, calibration=None):
        from zoo.layerwise import compress_in_memory

        if not self.layerwise:
            raise NotImplementedError(f"{type(self).__name__} implements neither compress nor compress_layer")
        return compress_in_memory(model, [self], calibration)


class Adapter(Component):
    """``attach(model) -> model``; optional ``train_step`` and ``merge``."""

    def attach(self, model):  # pragma: no cover - abstract
        raise NotImplementedError


@dataclass
class Registered:
    kind: str
    name: str
    obj: object  # the class (or the Family / ModelEntry instance)
    plugin: str
    distribution: str

    @property
    def summary(self) -> str:
        return getattr(self.obj, "summary", "")

    def info(self) -> dict:
        o = self.obj
        return {"name": self.name, "kind": self.kind, "summary": self.summary,
                "paper": getattr(o, "paper", ""), "card": getattr(o, "card", ""), "space": getattr(o, "space", ""),
                "plugin": self.plugin, "distribution": self.distribution}


@dataclass
class Registry:
    by_kind: dict[str, dict[str, Registered]] = field(default_factory=lambda: {k: {} for k in KINDS.values()})

    def add_all(self, entries: list[Registered]) -> None:
        """Add a plugin's entries all at once, or none: a name is never replaced, neither one already in the
        registry nor one earlier in ``entries`` (a clash names both distributions)."""
        seen: dict[tuple[str, str], Registered] = {}
        for e in entries:
            have = self.by_kind[e.kind].get(e.name) or seen.get((e.kind, e.name))
            if have is not None:
                raise ValueError(
                    f"{e.kind} {e.name!r} is registered twice: by {have.distribution} ({have.plugin}) "
                    f"and by {e.distribution} ({e.plugin})")
            seen[e.kind, e.name] = e
        for e in entries:
            self.by_kind[e.kind][e.name] = e

    def get(self, kind: str | None, name: str) -> Registered:
        kinds = [kind] if kind else list(self.by_kind)
        for k in kinds:
            if name in self.by_kind[k]:
                return self.by_kind[k][name]
        known = [n for k in kinds for n in self.by_kind[k]]
        what = f"{kind} component" if kind else "component"
        raise KeyError(f"no {what} named {name!r}{suggest(name, known)}")

    def all(self, kind: str | None = None) -> list[Registered]:
        kinds = [kind] if kind else list(self.by_kind)
        for k in kinds:
            if k not in self.by_kind:
                raise KeyError(f"unknown kind {k!r}{suggest(k, self.by_kind)}; kinds: {', '.join(self.by_kind)}")
        return sorted((e for k in kinds for e in self.by_kind[k].values()), key=lambda e: (e.kind, e.name))
