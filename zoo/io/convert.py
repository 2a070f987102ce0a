"""zoo.convert (native -> zoo, lossless) and zoo.export (zoo -> native, when the layout allows)."""
from __future__ import annotations

import os

from zoo.io.atomic import atomic_directory
from zoo.moe import context as routing_context
from zoo.moe.layout import (block_attr, block_prefix, decoder_layers, family_and_base, moe_layers,
                            native_block_prefix, sync_layout)
from zoo.architectures.lookup import family_of  # noqa: F401  (zoo.io.convert.family_of, as before)
from zoo.architectures.native import export_padding, native_block_state, native_config  # noqa: F401  (as before)


def convert(model):
    """Swap each native MoE block for a SparseMoE holding the same weights; the model becomes ``zoo_<family>``.

    Attention, norms and embeddings stay the family's own. Logits are unchanged (within float rounding).
    """
    from zoo.architectures.factory import adopt

    fam = family_of(model)
    if getattr(type(model), "zoo_family", None) is not None:
        return model  # already converted
    config = model.config
    fam.discover(getattr(model, fam.base_attr))
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
    if not getattr(family_and_base(model)[1], "_output_capturing_hooks_installed", False):
        return
    from transformers.utils.output_capturing import install_output_capuring_hook

    for router in routers if routers is not None else [moe.router for _, moe in moe_layers(model)]:
        install_output_capuring_hook(router, "router_logits", 2)


FORMATS = ("native", "gguf", "compressed-tensors")


def export(model, path, format: str = "native") -> str:
    """Write the family's native checkpoint (loadable by plain transformers, vLLM, TGI), with the tokenizer,
    chat template and processor files of the folder the model came from, or raise ``NotExportable`` naming why
    the layout has no native form. ``format="gguf"``: one GGUF file at ``path`` for llama.cpp and Ollama
    (``zoo.io.gguf_export``), quantized experts kept in GGUF's blocks. ``format="compressed-tensors"``: the native
    layout with int8 experts and linear layers as compressed-tensors' W8A16 (``zoo.io.compressed_tensors_export``),
    which vLLM and transformers load as they are."""
    from zoo.io.loading import copy_side_files

    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if format == "gguf":
        from zoo.io.gguf_export import check_target_file, export_gguf

        check_target_file(path)
        export_gguf(model, path)
        return os.fspath(path)

    from zoo.io.outputs import check_output_apart

    check_output_apart(path, model, what="the export")  # a native config over the zoo folder it came from: refused
    if format == "compressed-tensors":
        from zoo.io.compressed_tensors_export import export_compressed_tensors

        return export_compressed_tensors(model, path)  # checks the model first, then writes through atomic_directory
    fam = family_of(model)
    native_cfg = native_config(model, expand_maps=True)
    count = max(moe.unmapped().num_experts for _, moe in moe_layers(model))  # what padded layers are padded to
    state = dict(model.state_dict())
    for i, moe in moe_layers(model):
        prefix = block_prefix(model, i)
        for key in [k for k in state if k.startswith(prefix)]:
            del state[key]
        native_prefix = native_block_prefix(model, i)  # Gemma 4 keeps them in the decoder layer itself
        for key, value in native_block_state(fam, moe.unmapped(), count).items():
            for prefix in (native_prefix, *fam.native_copies(native_prefix)):  # tied copies too (Diffusion Gemma)
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
