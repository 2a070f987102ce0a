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


def sync_layout(model) -> None:
    model.config.zoo_layout = read_layout(model)


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
