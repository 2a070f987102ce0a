"""compressed-tensors export: a quantized zoo model as the checkpoint llm-compressor writes, which vLLM and
transformers' own compressed-tensors quantizer load without the zoo.

What is written: the family's native layout (the keys ``zoo.export`` writes, with the MoE experts split per expert
the way the family's own checkpoints name them, e.g. Mixtral's ``block_sparse_moe.experts.3.w1``; transformers
merges them back on load), each int8 matrix as ``weight_packed`` (its codes in int32 words, compressed-tensors'
own packing), ``weight_scale`` ``[out, 1]`` and ``weight_shape``, and ``quantization_config`` in config.json:
W8A16, ``pack-quantized``, channel-wise and symmetric. The zoo's int8 is exactly that (``w = q s``, one scale per
output row, ``q = round(w / s)`` in -127..127), so the codes and scales are the zoo's own and the weights bit-exact.
A quantized LM head is written as the exact float weight it stands for: vLLM builds the LM head unquantized.

What is refused (``NotCompressedTensorsExportable``, before anything is written), with the reason:
  * 4-bit weights: the zoo stores ``w = (q - 8) s + z`` with a real-valued zero ``z`` per group (GGUF's Q4_1
    form, which its int4 kernel computes); compressed-tensors' asymmetric int4 holds an integer zero point,
    ``w = (q - zp) s``, so these codes have no exact form there. Nor does transformers 5.24 (with compressed-tensors
    0.20) load any asymmetric pack-quantized weight on CPU: its fused-expert loader builds each expert without
    ``weight_zero_point`` ("Asymmetric quant requires zero-point values"), and a quantized Linear is created with
    the zero point unpacked ``[out, groups]`` where the format stores it packed ``[out / 8, groups]`` (a size
    mismatch: re-initialised). Symmetric W4A16 does load (``w = q s``), but the zoo's int4 is not symmetric.
  * 2- and 3-bit weights (the same real-valued zero; vLLM's compressed-tensors kernels read 4 and 8 bits);
  * experts of mixed widths in a layer, or quantized in some layers and not others (one scheme covers them all),
    or float experts beside quantized layers (transformers 5.24 reads a compressed-tensors checkpoint's experts
    through its quantized-expert loader only: float experts come out empty);
  * experts that are not integer-quantized SwiGLU stacks, experts with biases, merged experts behind an expert
    map, and families whose checkpoints keep experts fused (compressed-tensors quantizes Linear layers).
"""
from __future__ import annotations

import copy
import json
import os

import torch

SHARD_BYTES = 5 * 2**30  # safetensors shards of at most this size (one file when the model fits)
W8A16 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
ASYMMETRIC = ("stored as w = (q - 8) s + z with a real-valued zero z per group (GGUF's Q4_1 form): "
              "compressed-tensors' asymmetric int4 holds an integer zero point, w = (q - zp) s, so the codes have no "
              "exact form there, and transformers 5.24 loads no asymmetric pack-quantized weight on CPU (its "
              "fused-expert loader drops weight_zero_point; a quantized Linear expects it unpacked)")
INSTEAD = "quantize with bits=8 (W8A16, exact), or export to GGUF (format='gguf'), which keeps these codes"


class NotCompressedTensorsExportable(ValueError):
    """The model has a part the compressed-tensors format (or the family's checkpoint layout) cannot hold."""


# ------------------------------------------------------------------------------------------------- the checks

def check_model(model) -> None:
    """Refuse what compressed-tensors (or the family's checkpoint layout) has no exact form for, naming why."""
    from zoo.layout import moe_layers
    from zoo.moe.experts import SwiGLUExperts
    from zoo.moe.quantized_linear import QuantizedLinear

    layers = moe_layers(model)
    if len({type(moe.experts) is SwiGLUExperts for _, moe in layers}) > 1:
        raise NotCompressedTensorsExportable("some layers' experts are quantized and others are not: the "
                                             "checkpoint's one scheme covers every layer's experts")
    for i, moe in layers:
        check_experts(i, moe)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    for name, linear in linears.items():
        if linear.bits != 8:
            raise NotCompressedTensorsExportable(f"{name} is a {linear.bits}-bit linear layer, {ASYMMETRIC}; {INSTEAD}")
    if all(type(moe.experts) is SwiGLUExperts for _, moe in layers):
        if not linears:
            raise NotCompressedTensorsExportable("nothing is quantized: apply 'quantize' (bits=8) first, or write "
                                                 "the native float checkpoint with zoo.export(model, path)")
        raise NotCompressedTensorsExportable(
            "the linear layers are quantized but the experts are float: transformers 5.24 reads a compressed-tensors "
            "checkpoint's experts through its quantized-expert loader only (float experts come out empty); quantize "
            "the experts too")


def check_experts(i: int, moe) -> None:
    from zoo.moe.experts import SwiGLUExperts
    from zoo.moe.quantized import QuantizedExperts

    experts = moe.experts
    if moe.expert_map is not None:
        raise NotCompressedTensorsExportable(
            f"layer {i} serves its router's {moe.router.num_experts} experts with {moe.num_experts} merged ones (an "
            "expert map): a checkpoint holds one expert per router row; export natively (zoo.export expands the map)")
    if type(experts) is SwiGLUExperts:
        return
    if type(experts) is not QuantizedExperts:
        raise NotCompressedTensorsExportable(
            f"layer {i} has {getattr(experts, 'name', type(experts).__name__)!r} experts: compressed-tensors holds "
            "integer codes with scales (the quantize compressor's dtype='int' experts)")
    widths = sorted(set(experts.bits))
    if len(widths) > 1:
        raise NotCompressedTensorsExportable(
            f"layer {i} mixes expert widths {widths}: compressed-tensors has no per-expert width (transformers merges "
            "a layer's experts into one tensor, vLLM into one fused-MoE layer, each with one scheme); quantize with "
            "allocation='uniform'")
    if widths[0] in (2, 3):
        raise NotCompressedTensorsExportable(
            f"layer {i} has {widths[0]}-bit experts: vLLM's compressed-tensors kernels (WNA16) read 4 and 8 bits, and "
            f"these groups are {ASYMMETRIC}; {INSTEAD}")
    if widths[0] != 8:
        raise NotCompressedTensorsExportable(f"layer {i} has {widths[0]}-bit experts, {ASYMMETRIC}; {INSTEAD}")
    if experts.gate_up_proj_bias is not None or experts.down_proj_bias is not None:
        raise NotCompressedTensorsExportable(
            f"layer {i}: quantized experts with biases (GPT-OSS's, whose checkpoint keeps its experts fused): "
            "compressed-tensors quantizes Linear layers, and transformers rebuilds quantized experts from per-expert "
            "weights without biases")


# ------------------------------------------------------------------------------------------------- native names

def native_skeleton(model):
    """(family, native config, the native model on the meta device) for a quantized zoo model, its layout read as
    the dense layout the quantized parts stand for."""
    from zoo.convert import family_of
    from zoo.layout import moe_layers, read_layout
    from zoo.moe.quantized import QuantizedExperts

    fam = family_of(model)
    layout = read_layout(model)
    for i, moe in moe_layers(model):
        if isinstance(moe.experts, QuantizedExperts):
            entry = copy.deepcopy(layout[i])
            entry["experts"] = "swiglu"
            for key in ("bits", "group_size", "group_sizes"):
                entry["experts_options"].pop(key, None)
            layout[i] = entry
    config = copy.deepcopy(model.config)
    modules = getattr(config, "zoo_modules", None) or {}
    config.zoo_modules = {k: v for k, v in modules.items() if v.get("compressor") != "quantize"}
    native_cfg = fam.native_config(config, layout)
    native_cfg.architectures = [fam.model_class.__name__]
    native_cfg.__dict__.pop("auto_map", None)  # the family's own classes: no moe-zoo code to point at
    # the zoo's model type was copied over the class's: transformers looks its weight conversion (the per-expert
    # checkpoint names) up by the family's own
    native_cfg.__dict__.pop("model_type", None)
    with torch.device("meta"):
        native = fam.model_class(native_cfg)
    return fam, native_cfg, native


def kept_float(name: str) -> bool:
    """A quantized layer written as the exact float weight it stands for (float32 ``q s``): the LM head, which vLLM
    builds as a ``ParallelLMHead`` taking no compressed-tensors scheme (llm-compressor leaves it float too)."""
    return name == "lm_head"


def zoo_tensors(model) -> tuple[dict, dict]:
    """The state dict under the zoo's names with the int8 codes ``[.., N, K]`` in place of each quantized matrix (a
    linear layer's ``X.weight``, a layer's ``experts.gate_up_proj`` / ``experts.down_proj`` stacks), and their
    row scales ``[.., N, 1]`` under the same keys, so renames and the per-expert split move both alike."""
    from zoo.layout import block_prefix, moe_layers
    from zoo.moe.quantized import QuantizedExperts
    from zoo.moe.quantized_linear import QuantizedLinear

    stored, codes, scales = set(), {}, {}
    for name, linear in model.named_modules():
        if isinstance(linear, QuantizedLinear):
            stored |= {f"{name}.{b}" for b, _ in linear.named_buffers(recurse=False)}
            if kept_float(name):
                codes[f"{name}.weight"] = scales[f"{name}.weight"] = linear.dequantized()
                continue
            codes[f"{name}.weight"], scale = linear.packed
            scales[f"{name}.weight"] = scale.float()[:, None]
    for i, moe in moe_layers(model):
        if isinstance(moe.experts, QuantizedExperts):
            prefix = f"{block_prefix(model, i)}experts."
            stored |= {prefix + b for b, _ in moe.experts.named_buffers(recurse=False)}
            for proj in ("gate_up", "down"):
                codes[f"{prefix}{proj}_proj"], scale = moe.experts.stored(proj, 8)
                scales[f"{prefix}{proj}_proj"] = scale.float()[..., None]
    main = {k: v for k, v in model.state_dict().items() if k not in stored}
    odd = [k for k, v in main.items() if v.dtype == torch.int8]
    if odd:  # int8 marks the quantized matrices from here on
        raise NotCompressedTensorsExportable(f"{odd[0]} is an int8 tensor outside the quantize compressor's modules")
    return {**main, **codes}, {**main, **scales}


def native_state(model, fam, sd: dict) -> dict:
    """A zoo-named state dict under the native model's names: MoE blocks through the family's own renames, as
    ``zoo.export`` writes them."""
    from zoo.layout import block_prefix, moe_layers

    sd = dict(sd)
    for i, _ in moe_layers(model):
        prefix = block_prefix(model, i)
        block = {k[len(prefix):]: sd.pop(k) for k in [k for k in sd if k.startswith(prefix)]}
        sd.update({prefix + k: v for k, v in fam.to_native_state(block).items()})
    return sd


def check_native_keys(native, sd: dict) -> None:
    """Every tensor of the native model in its shape, and nothing else (what ``zoo.export``'s strict load checks)."""
    want = {k: tuple(v.shape) for k, v in native.state_dict().items()}
    missing, extra = sorted(set(want) - set(sd)), sorted(set(sd) - set(want))
    wrong = [k for k in want if k in sd and tuple(sd[k].shape) != want[k]]
    if missing or extra or wrong:
        raise NotCompressedTensorsExportable(f"the native {type(native).__name__} does not take these tensors "
                                             f"(missing {missing[:3]}, unexpected {extra[:3]}, shape {wrong[:3]})")


def compressed_state(codes: dict, scales: dict) -> dict:
    """Checkpoint-named state dicts as compressed-tensors stores them: each int8 ``X.weight`` becomes
    ``X.weight_packed`` / ``X.weight_scale`` / ``X.weight_shape``; float tensors stay as they are."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    out = {}
    for key, q in codes.items():
        if q.dtype != torch.int8:
            out[key] = q
            continue
        scale = scales[key]
        if not key.endswith(".weight") or q.dim() != 2 or tuple(scale.shape) != (q.shape[0], 1):
            raise NotCompressedTensorsExportable(
                f"{key}: the family's checkpoint does not store this matrix as a Linear weight [out, in] (its experts "
                f"stay fused, shape {tuple(q.shape)}): compressed-tensors quantizes Linear layers")
        module = key.removesuffix(".weight")
        out[f"{module}.weight_packed"] = pack_to_int32(q.contiguous(), 8)
        out[f"{module}.weight_scale"] = scale.contiguous()  # float32: the zoo's scales exactly
        out[f"{module}.weight_shape"] = torch.tensor(list(q.shape))
    return out


# ------------------------------------------------------------------------------------------------- the config

def quantization_config(ignore: list[str]) -> dict:
    """config.json's ``quantization_config``, validated by compressed-tensors' own model: W8A16 targeting ``Linear``
    as llm-compressor writes it (what vLLM's fused-MoE layers and transformers' expert loader look for), ``ignore``
    naming the float linear layers."""
    from compressed_tensors.quantization import QuantizationConfig

    group = {"targets": ["Linear"], "weights": W8A16, "format": "pack-quantized"}
    config = QuantizationConfig.model_validate({"config_groups": {"group_0": group}, "format": "pack-quantized",
                                                "quantization_status": "compressed", "ignore": sorted(ignore),
                                                "quant_method": "compressed-tensors"})
    return config.model_dump()


def checkpoint_names(native, names) -> set:
    """Module names under transformers' names and the checkpoint's (its reverse renames, e.g. Mixtral's ``mlp`` ->
    ``block_sparse_moe``): transformers matches the former, vLLM the latter."""
    from transformers.core_model_loading import revert_weight_conversion

    names = set(names)
    saved = revert_weight_conversion(native, {f"{n}.weight": native.get_submodule(n).weight for n in names})
    return names | {k.removesuffix(".weight") for k in saved}


# ------------------------------------------------------------------------------------------------- the export

def export_compressed_tensors(model, path) -> str:
    """Write ``model`` (an in-memory zoo model whose experts, and with ``targets="all"`` linear layers, are
    quantized to int8) to the folder ``path`` as a compressed-tensors checkpoint of its native family, with the
    tokenizer of the folder it came from; refused (``NotCompressedTensorsExportable``, nothing written) where the
    format has no exact form for a part. The folder appears complete or not at all (``zoo.atomic``)."""
    from transformers.core_model_loading import revert_weight_conversion

    from zoo.atomic import atomic_directory
    from zoo.loading import check_output_apart, copy_side_files
    from zoo.moe.quantized_linear import QuantizedLinear

    check_output_apart(path, model, what="the export")
    check_model(model)
    fam, native_cfg, native = native_skeleton(model)
    codes, scales = (native_state(model, fam, sd) for sd in zoo_tensors(model))
    check_native_keys(native, codes)
    quantized = {k for k, v in codes.items() if v.dtype == torch.int8}
    tied = getattr(native_cfg.get_text_config(), "tie_word_embeddings", False)
    if tied and isinstance(getattr(model, "lm_head", None), QuantizedLinear):
        raise NotCompressedTensorsExportable("the LM head is quantized but tied to the float input embeddings")
    tensors = compressed_state(revert_weight_conversion(native, codes), revert_weight_conversion(native, scales))
    if tied:
        tensors.pop("lm_head.weight", None)  # transformers ties it to the embeddings on load
    floats = {n for n, m in native.named_modules() if isinstance(m, torch.nn.Linear) and f"{n}.weight" not in quantized}
    native_cfg.quantization_config = quantization_config(sorted(checkpoint_names(native, floats)))
    with atomic_directory(path) as tmp:
        copy_side_files(getattr(model.config, "name_or_path", ""), tmp)  # the tokenizer travels with the weights
        native_cfg.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        write_shards(tensors, tmp)
    return os.fspath(path)


def write_shards(tensors: dict, folder: str) -> None:
    """safetensors shards of at most ``SHARD_BYTES`` (one ``model.safetensors`` when it fits) and the index
    transformers reads."""
    from safetensors.torch import save_file

    shards, size = [{}], 0
    for key in sorted(tensors):
        t = tensors[key].detach().cpu().contiguous()
        nbytes = t.numel() * t.element_size()
        if t.untyped_storage().nbytes() != nbytes:
            t = t.clone()  # a view (one expert's slice of a stack): safetensors stores no shared memory
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][key], size = t, size + nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for n, shard in enumerate(shards, 1):
        name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(folder, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        total += sum(t.numel() * t.element_size() for t in shard.values())
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
