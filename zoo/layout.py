"""Per-layer structure of a zoo model (``config.zoo_layout``): read it off a model, rebuild blocks from it."""
from __future__ import annotations

from zoo.moe import SharedMLP, SparseMoE


def moe_layers(model):
    """(layer index, SparseMoE) for every converted MoE layer of a model."""
    base = getattr(model, "model", model)
    return [(i, layer.mlp) for i, layer in enumerate(base.layers) if isinstance(layer.mlp, SparseMoE)]


def read_layout(model) -> list[dict | None]:
    base = getattr(model, "model", model)
    return [layer.mlp.layout() if isinstance(layer.mlp, SparseMoE) else None for layer in base.layers]


def read_modules(model) -> dict:
    """Modules an adapter put outside the MoE blocks (e.g. on attention projections): ``{path: spec}``. Such a
    module has ``zoo_spec()``, a JSON-able dict naming its ``adapter``, whose class rebuilds it empty with
    ``build_module(module_it_replaced, spec)``."""
    return {name: m.zoo_spec() for name, m in model.named_modules() if callable(getattr(m, "zoo_spec", None))}


def read_attention(model) -> list[dict | None]:
    """Per decoder layer, the ``layout()`` of a wrapped self-attention (a router with ``target = "attention"``,
    e.g. mixture-of-heads), or None where the family's own attention is unchanged."""
    base = getattr(model, "model", model)
    return [layer.self_attn.layout() if callable(getattr(layer.self_attn, "layout", None)) else None
            for layer in base.layers]


def sync_layout(model) -> None:
    model.config.zoo_layout = read_layout(model)
    modules = read_modules(model)
    if modules or getattr(model.config, "zoo_modules", None):
        model.config.zoo_modules = modules
    attention = read_attention(model)
    if any(attention) or getattr(model.config, "zoo_attention", None):
        model.config.zoo_attention = attention


def build_block(entry: dict) -> SparseMoE:
    """An empty (randomly initialised) SparseMoE with the structure an entry describes."""
    from zoo.plugins import load_plugins, registry

    load_plugins()
    router_cls = registry.get("router", entry["router"]).obj
    experts_cls = registry.get("experts", entry["experts"]).obj
    experts = experts_cls(**entry["experts_options"])
    router = router_cls(experts.hidden_size, entry["num_experts"], entry["num_experts_per_tok"],
                        **entry["router_options"])
    shared = SharedMLP(**entry["shared_experts"]) if entry.get("shared_experts") else None
    return SparseMoE(router, experts, shared, returns_router_scores=entry.get("returns_router_scores", False))


def apply_layout(model, layout) -> None:
    base = getattr(model, "model", model)
    for i, entry in enumerate(layout or []):
        if entry:
            base.layers[i].mlp = build_block(entry)


def apply_modules(model, modules) -> None:
    """Rebuild (empty) the adapter modules ``read_modules`` recorded, in place of the modules they wrapped."""
    from zoo.plugins import load_plugins, registry

    load_plugins()
    for path, spec in (modules or {}).items():
        parent, _, leaf = path.rpartition(".")
        owner = model.get_submodule(parent)
        cls = registry.get("adapter", spec["adapter"]).obj
        setattr(owner, leaf, cls.build_module(getattr(owner, leaf), spec))


def apply_attention(model, entries) -> None:
    """Rebuild (empty) the wrapped self-attention ``read_attention`` recorded: ``attach(model, layers=[i], **options)``
    of the router class each entry names."""
    from zoo.plugins import load_plugins, registry

    load_plugins()
    for i, entry in enumerate(entries or []):
        if entry:
            registry.get("router", entry["router"]).obj.attach(model, layers=[i], **entry["options"])
