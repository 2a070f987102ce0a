"""The keys a zoo model's config carries besides its family's own, declared in one place (the zoo config
classes, ``zoo_mm``'s included, declare these attributes; ``zoo.moe.layout.sync_layout`` writes the structural ones
before every save)."""
from __future__ import annotations

ZOO_KEYS = {
    "zoo_layout": "per decoder layer, the SparseMoE.layout() of its MoE block (None for a dense layer)",
    "zoo_recipe": "the steps applied, in order: name, kind, options, calibration, results, distribution, version",
    "zoo_components": "'kind:name' -> {distribution, version} of every component the model is built from",
    "zoo_modules": "adapter modules outside the MoE blocks, {module path: spec} (see zoo.moe.layout.read_modules)",
    "zoo_attention": "per decoder layer, the layout of a self-attention a router wraps (None where unchanged)",
    "zoo_base_model": "the Hub id a converted model came from (the card's base_model)",
    "zoo_vision_moe": "zoo_mm only: the layout of the block that transforms the visual tokens",
}
CLASS_KEYS = ("zoo_layout", "zoo_recipe", "zoo_components")  # declared on every zoo config class (None = unset)
