"""zoo.convert (native -> zoo, lossless) and zoo.export (zoo -> native, when the layout allows)."""
from __future__ import annotations

import os

from zoo.atomic import atomic_directory
from zoo.moe import context as routing_context
from zoo.layout import block_attr, block_prefix, decoder_layers, moe_layers, read_layout, sync_layout
from zoo.registry import registry


def family_of(model):
    """The registered Family whose native (or zoo) classes this model uses."""
    zoo_family = getattr(type(model), "zoo_family", None)
    if zoo_family is not None:
        return zoo_family
    families = [r.obj for r in registry.all("architecture")]
    matching = [fam for fam in families if fam.matches(model)]
    if matching:  # the most specific: a plugin family built on a subclass of Mixtral's model wins over Mixtral
        mro = type(model).__mro__
        return min(matching, key=lambda fam: mro.index(fam.model_class) if fam.model_class in mro else len(mro))
    from zoo.architectures.families import EXCEPTIONS
    from zoo.architectures.family import NotConvertible

    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        raise TypeError(f"{type(model).__name__} carries a PEFT adapter: fold it in first "
                        "(model = model.merge_and_unload(), or moe-zoo merge ADAPTER OUT)")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in EXCEPTIONS:
        raise NotConvertible(f"{type(model).__name__} ({model_type}) is not converted: {EXCEPTIONS[model_type]}")
    known = ", ".join(f.name for f in families)
    raise TypeError(f"{type(model).__name__} is not a supported MoE family (supported: {known})")


def convert(model):
    """Swap each native MoE block for a SparseMoE holding the same weights; the model becomes ``zoo_<family>``.

    Attention, norms and embeddings stay the family's own. Logits are unchanged (within float rounding).
    """
    from zoo.architectures.factory import adopt

    fam = family_of(model)
    if getattr(type(model), "zoo_family", None) is not None:
        return model  # already converted
    config = model.config
    fam.discover(model.model)
    attr = block_attr(model, fam)
    blocks = [(layer, fam.from_native(getattr(layer, attr), config)) for layer in decoder_layers(model, fam)
              if isinstance(getattr(layer, attr, None), fam.block_class)]  # all built before any is swapped
    for layer, block in blocks:
        setattr(layer, attr, block)
    adopt(model, fam)
    # transformers saves a model under the key names it was loaded from (e.g. Mixtral's per-expert w1/w2/w3
    # of older checkpoints); a zoo model saves under its own names, which is what loading it expects
    model._weight_conversions = []
    source = getattr(config, "_name_or_path", "") or ""
    if "/" in source and not os.path.exists(source):  # loaded from the Hub: the card's base_model
        config.zoo_base_model = source
    sync_layout(model)
    hook_new_routers(model)
    routing_context.attach(model)  # converted routers that read the routing context (DeepSeek-V4's hash layers)
    return model


def hook_new_routers(model, routers=None):
    """Routers added after transformers installed its output recorders need the recorder too."""
    if not getattr(model.model, "_output_capturing_hooks_installed", False):
        return
    from transformers.utils.output_capturing import install_output_capuring_hook

    for router in routers if routers is not None else [moe.router for _, moe in moe_layers(model)]:
        install_output_capuring_hook(router, "router_logits", 2)


def native_config(model, expand_maps: bool = False):
    """The family's native config for ``model``'s layout, or ``NotExportable`` with the reason (a model in memory,
    or a streamed checkpoint's skeleton on the meta device)."""
    from zoo.architectures.family import NotExportable

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
    from zoo.architectures.family import NotExportable

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


FORMATS = ("native", "gguf", "compressed-tensors")


def export(model, path, format: str = "native") -> str:
    """Write the family's native checkpoint (loadable by plain transformers, vLLM, TGI), with the tokenizer,
    chat template and processor files of the folder the model came from, or raise ``NotExportable`` naming why
    the layout has no native form. ``format="gguf"``: one GGUF file at ``path`` for llama.cpp and Ollama
    (``zoo.gguf_export``), quantized experts kept in GGUF's blocks. ``format="compressed-tensors"``: the native
    layout with int8 experts and linear layers as compressed-tensors' W8A16 (``zoo.compressed_tensors_export``),
    which vLLM and transformers load as they are."""
    from zoo.loading import copy_side_files

    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if format == "gguf":
        from zoo.gguf_export import check_target_file, export_gguf

        check_target_file(path)
        export_gguf(model, path)
        return os.fspath(path)

    from zoo.loading import check_output_apart

    check_output_apart(path, model, what="the export")  # a native config over the zoo folder it came from: refused
    if format == "compressed-tensors":
        from zoo.compressed_tensors_export import export_compressed_tensors

        return export_compressed_tensors(model, path)  # checks the model first, then writes through atomic_directory
    fam = family_of(model)
    native_cfg = native_config(model, expand_maps=True)
    count = max(moe.unmapped().num_experts for _, moe in moe_layers(model))  # what padded layers are padded to
    state = dict(model.state_dict())
    for i, moe in moe_layers(model):
        prefix = block_prefix(model, i)
        for key in [k for k in state if k.startswith(prefix)]:
            del state[key]
        for key, value in native_block_state(fam, moe.unmapped(), count).items():
            state[prefix + key] = value
    import torch

    with torch.device("meta"):
        native = fam.model_class(native_cfg)
    native.load_state_dict(state, strict=True, assign=True)
    if getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        native.tie_weights()
    native.generation_config = model.generation_config
    with atomic_directory(path) as tmp:
        copy_side_files(getattr(model.config, "name_or_path", ""), tmp)  # the tokenizer travels with the weights
        native.save_pretrained(tmp)
    return os.fspath(path)
