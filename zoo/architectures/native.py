"""A zoo model's layout in its family's native form: the native config that expresses it (or why none can), each
block's state in the family's names, and what padding layers to one expert count costs."""
from __future__ import annotations

from zoo.architectures.lookup import family_of
from zoo.moe.layout import moe_layers, read_layout


def native_config(model, expand_maps: bool = False):
    """The family's native config for ``model``'s layout, or ``NotExportable`` with the reason (a model in memory,
    or a streamed checkpoint's skeleton on the meta device)."""
    from zoo.architectures.lookup import NotExportable

    fam = family_of(model)
    for i, moe in moe_layers(model):
        if type(moe.experts).__name__ not in ("SwiGLUExperts", "MLPExperts"):
            raise NotExportable(f"layer {i} has {moe.experts.name!r} experts; native {fam.name} needs dense experts")
        if moe.expert_map is not None and not expand_maps:
            raise NotExportable(f"layer {i} serves its router's {moe.router.num_experts} experts with "
                                f"{moe.num_experts} merged ones (an expert map, hc-smoe's default): a native "
                                f"{fam.name} block has one expert per router row; export it from memory "
                                "(--no-stream), which writes each merged expert once per row it serves")
    layout = read_layout(model)
    for i, moe in moe_layers(model):
        if moe.expert_map is not None:
            layout[i] = moe.unmapped().layout()  # one expert per router row
    native_cfg = fam.native_config(model.config, layout)
    native_cfg.architectures = [fam.model_class.__name__]
    native_cfg.__dict__.pop("auto_map", None)  # the family's own classes: no moe-zoo code to point at
    # the zoo type copied onto the instance would hide the family's own from transformers, which then could not
    # find the family's key-name reversal and would write fused expert keys instead of the family's checkpoint names
    native_cfg.__dict__.pop("model_type", None)
    return native_cfg


def native_block_state(fam, moe, count: int) -> dict:
    """One MoE block's state in the family's native names, padded to ``count`` experts where it has fewer."""
    state = fam.to_native_state(moe.state_dict())
    return fam.pad_native_state(state, count) if moe.num_experts < count else state


def export_padding(model) -> dict | None:
    """What a native export pads (None when nothing): ``{"num_experts": n, "layers": {layer: experts added},
    "bytes": bytes of the experts added}`` (each added expert costs what one of its layer's experts costs)."""
    from zoo.architectures.lookup import NotExportable

    if family_of(model).padding_bias_key is None:  # such a family's native config holds no padded layer
        return None
    try:
        native_config(model, expand_maps=True)
    except (NotExportable, TypeError, ValueError):
        return None
    count = max(moe.unmapped().num_experts for _, moe in moe_layers(model))
    layers, added = {}, 0
    for i, moe in moe_layers(model):
        moe = moe.unmapped()
        if moe.num_experts < count:
            layers[i] = count - moe.num_experts
            added += layers[i] * moe.experts.nbytes() // moe.num_experts
    return {"num_experts": count, "layers": layers, "bytes": added} if layers else None
