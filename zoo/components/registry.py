"""The registry (timm style): every component, architecture and model entry the plugins registered, by kind
and name, with the plugin and distribution that provided it.

It fills itself on first use: the first lookup runs ``zoo.components.plugins.load_plugins`` (the loader sets
``registry.loader``), so importing a plugin module never loads the plugins half-way.
"""
from __future__ import annotations

import fnmatch
from dataclasses import asdict, dataclass, field

from zoo.components.options import suggest

# hook name -> component kind
KINDS = {
    "register_architectures": "architecture",
    "register_routers": "router",
    "register_experts": "experts",
    "register_adapters": "adapter",
    "register_compressors": "compressor",
    "register_models": "model",
}


@dataclass(frozen=True)
class ModelEntry:
    name: str  # "<family>.<tag>", e.g. "mixtral.8x7b-v0.1"
    hub_id: str | None  # None for checkpoints that exist only in the zoo's own folder
    family: str
    license: str
    paper: str
    summary: str = ""
    local_path: str | None = None  # checkpoints shipped with the zoo load offline from here

    def info(self) -> dict:
        return asdict(self)


@dataclass
class Registered:
    kind: str
    name: str
    obj: object  # the class (or the Family / ModelEntry instance)
    plugin: str
    distribution: str
    version: str = "?"

    @property
    def summary(self) -> str:
        return getattr(self.obj, "summary", "")

    @property
    def provenance(self) -> dict:
        """What a saved model records about where this component came from."""
        return {"distribution": self.distribution, "version": self.version}

    def info(self) -> dict:
        o = self.obj
        return {"name": self.name, "kind": self.kind, "summary": self.summary,
                "paper": getattr(o, "paper", ""), "card": getattr(o, "card", ""), "space": getattr(o, "space", ""),
                "plugin": self.plugin, "distribution": self.distribution, "version": self.version}


@dataclass
class Registry:
    loader: object = None  # called once before the first lookup (zoo.components.plugins.load_plugins)
    entries: dict[str, dict[str, Registered]] = field(default_factory=lambda: {k: {} for k in KINDS.values()})

    @property
    def by_kind(self) -> dict[str, dict[str, Registered]]:
        """``{kind: {name: Registered}}``, loaded."""
        if self.loader is not None:
            self.loader()
        return self.entries

    def add_all(self, entries: list[Registered]) -> None:
        """Add a plugin's entries all at once, or none: a name is never replaced, neither one already in the
        registry nor one earlier in ``entries`` (a clash names both distributions)."""
        seen: dict[tuple[str, str], Registered] = {}
        for e in entries:
            have = self.entries[e.kind].get(e.name) or seen.get((e.kind, e.name))
            if have is not None:
                raise ValueError(
                    f"{e.kind} {e.name!r} is registered twice: by {have.distribution} ({have.plugin}) "
                    f"and by {e.distribution} ({e.plugin})")
            seen[e.kind, e.name] = e
        for e in entries:
            self.entries[e.kind][e.name] = e

    def find(self, kind: str, name: str) -> Registered | None:
        return self.by_kind.get(kind, {}).get(name)

    def get(self, kind: str | None, name: str) -> Registered:
        by_kind = self.by_kind
        kinds = [kind] if kind else list(by_kind)
        for k in kinds:
            if name in by_kind[k]:
                return by_kind[k][name]
        known = [n for k in kinds for n in by_kind[k]]
        what = f"{kind} component" if kind else "component"
        raise KeyError(f"no {what} named {name!r}{suggest(name, known)}")

    def all(self, kind: str | None = None) -> list[Registered]:
        by_kind = self.by_kind
        kinds = [kind] if kind else list(by_kind)
        for k in kinds:
            if k not in by_kind:
                raise KeyError(f"unknown kind {k!r}{suggest(k, by_kind)}; kinds: {', '.join(by_kind)}")
        return sorted((e for k in kinds for e in by_kind[k].values()), key=lambda e: (e.kind, e.name))


registry = Registry()


def list_models(pattern: str = "*") -> list[ModelEntry]:
    """Registered models whose name matches the fnmatch ``pattern`` (case-insensitive)."""
    entries = (r.obj for r in registry.all("model"))
    return sorted((e for e in entries if fnmatch.fnmatch(e.name.lower(), pattern.lower())), key=lambda e: e.name)


def get_model(name: str) -> ModelEntry:
    """An entry by its full ``arch.tag`` name, or by its tag alone. The zoo's own entries come first, so a
    third-party plugin never shadows one of them; a name that fits several third-party entries is an error."""
    models = registry.by_kind["model"]
    hits = [r for n, r in models.items() if name in (n, n.split(".", 1)[-1])]
    for group in ([r for r in hits if r.distribution == "moe-zoo"], hits):
        exact = [r for r in group if r.name == name]  # full names are unique
        if exact or len(group) == 1:
            return (exact or group)[0].obj
        if group:
            raise KeyError(f"model name {name!r} is ambiguous: it fits "
                           f"{', '.join(f'{r.name} ({r.distribution})' for r in group)}; use the full name")
    tags = {n.split(".", 1)[-1] for n in models}
    raise KeyError(f"no model named {name!r}{suggest(name, sorted(set(models) | tags))}")


def is_model_name(name: str) -> bool:
    try:
        get_model(name)
        return True
    except KeyError:
        return False
