"""compressed-tensors export: a quantized zoo model as the checkpoint llm-compressor writes, which vLLM and
transformers' own compressed-tensors quantizer load without the zoo.

What is written: the family's native layout (the keys ``zoo.export`` writes, with the MoE experts split per expert
the way the family's own checkpoints name them, e.g. Mixtral's ``block_sparse_moe.experts.3.w1``; transformers
merges them back on load), each quantized matrix as ``weight_packed`` (its codes in int32 words, compressed-tensors'
own packing, ``pack_to_int32``), ``weight_scale`` and ``weight_shape``, and ``quantization_config`` in config.json,
``pack-quantized`` with one scheme for every quantized matrix:
  * int8: W8A16, channel-wise and symmetric, ``weight_scale`` ``[out, 1]``. The zoo's int8 is exactly that
    (``w = q s``, one scale per output row, ``q = round(w / s)`` in -127..127);
  * symmetric int4 (``quantize(symmetric=True)``, whose stored zero is exactly 0 everywhere): W4A16, group-wise
    with the model's group size and symmetric, ``weight_scale`` ``[out, in / group]``. The zoo stores ``w = q s``
    with ``q`` in -8..7 (as codes ``q + 8`` that its int4 kernel reads as ``(u - 8) s + 0``), compressed-tensors'
    symmetric int4 range, and a bf16 scale per group (written as float32, the same value).
Either way the codes and scales are the zoo's own and the weights bit-exact. A quantized LM head is written as the
exact float weight it stands for: vLLM builds the LM head unquantized.

What is refused (``NotCompressedTensorsExportable``, before anything is written), with the reason:
  * asymmetric 4-bit weights (the quantize default): the zoo stores ``w = (q - 8) s + z`` with a real-valued zero
    ``z`` per group (GGUF's Q4_1 form, which its int4 kernel computes); compressed-tensors' asymmetric int4 holds an
    integer zero point, ``w = (q - zp) s``, so these codes have no exact form there. Nor does transformers 5.24
    (with compressed-tensors 0.20) load any asymmetric pack-quantized weight on CPU: its fused-expert loader builds
    each expert without ``weight_zero_point`` ("Asymmetric quant requires zero-point values"), and a quantized
    Linear is created with the zero point unpacked ``[out, groups]`` where the format stores it packed
    ``[out / 8, groups]`` (a size mismatch: re-initialised). The fix is named: quantize with ``symmetric=True``;
  * 2- and 3-bit weights (vLLM's compressed-tensors kernels read 4 and 8 bits);
  * quantized matrices of different widths or group sizes (an int8 fallback linear beside 4-bit ones, per-layer
    group sizes): the checkpoint's one scheme (transformers reads the experts through one config group);
  * experts of mixed widths in a layer, or quantized in some layers and not others (one scheme covers them all),
    or float experts beside quantized layers (transformers 5.24 reads a compressed-tensors checkpoint's experts
    through its quantized-expert loader only: float experts come out empty);
  * experts that are not integer-quantized stacks (``quantized``, or ungated ``quantized-mlp``), experts with
    biases, merged experts behind an expert map, and families whose checkpoints keep experts fused
    (compressed-tensors quantizes Linear layers), or that transformers cannot load from one (Switch Transformers).
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
INSTEAD = ("quantize with symmetric=True (w = q s: W4A16, exact) or bits=8 (W8A16, exact), or export to GGUF "
           "(format='gguf'), which keeps these codes")
INSTEAD_LOW = ("quantize with bits=4 and symmetric=True (W4A16, exact) or bits=8 (W8A16, exact), or export to GGUF "
               "(format='gguf'), which keeps these codes")


def w4a16(group_size: int) -> dict:
    """compressed-tensors' symmetric int4 weights, one scale per ``group_size`` inputs (llm-compressor's W4A16)."""
    return {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group_size,
            "dynamic": False}


def zero_is_zero(scale_zero: torch.Tensor) -> bool:
    """Whether stored int4 ``(scale, zero)`` pairs ``[..., 2]`` have the zero exactly 0 everywhere: the weights are
    then exactly ``(u - 8) s = q s`` with ``q`` in -8..7 (``quantize(symmetric=True)``), compressed-tensors' W4A16."""
    return bool((scale_zero[..., 1] == 0).all())


class NotCompressedTensorsExportable(ValueError):
    """The model has a part the compressed-tensors format (or the family's checkpoint layout) cannot hold."""


# ------------------------------------------------------------------------------------------------- the checks

def check_model(model) -> dict:
    """Refuse what compressed-tensors (or the family's checkpoint layout) has no exact form for, naming why; else the
    weights' quantization args of the checkpoint's one scheme (``W8A16``, or ``w4a16(group size)``)."""
    from zoo.moe.layout import moe_layers
    from zoo.moe.experts import MLPExperts, SwiGLUExperts
    from zoo.moe.quantized_linear import QuantizedLinear

    from zoo.architectures.lookup import family_of

    fam = family_of(model)
    if getattr(fam, "compressed_tensors_refused", None):
        raise NotCompressedTensorsExportable(f"{fam.name}: {fam.compressed_tensors_refused}")
    layers = moe_layers(model)
    if len({type(moe.experts) in (SwiGLUExperts, MLPExperts) for _, moe in layers}) > 1:
        raise NotCompressedTensorsExportable("some layers' experts are quantized and others are not: the "
                                             "checkpoint's one scheme covers every layer's experts")
    for i, moe in layers:
        check_experts(i, moe)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear) and not kept_float(name)}
    for name, linear in linears.items():
        if linear.bits != 8 and not zero_is_zero(linear.weight_scale_zero):
            raise NotCompressedTensorsExportable(f"{name} is a {linear.bits}-bit linear layer, {ASYMMETRIC}; {INSTEAD}")
    if all(type(moe.experts) in (SwiGLUExperts, MLPExperts) for _, moe in layers):
        if not linears:
            raise NotCompressedTensorsExportable("nothing is quantized: apply 'quantize' (bits=8) first, or write "
                                                 "the native float checkpoint with zoo.export(model, path)")
        raise NotCompressedTensorsExportable(
            "the linear layers are quantized but the experts are float: transformers 5.24 reads a compressed-tensors "
            "checkpoint's experts through its quantized-expert loader only (float experts come out empty); quantize "
            "the experts too")
    return one_scheme(layers, linears)


def one_scheme(layers, linears: dict) -> dict:
    """The weights' quantization args every quantized matrix shares (checked parts), or refused naming two that
    differ: the checkpoint holds one scheme (transformers reads the experts through one config group, and the
    quantize compressor gives a model one width and, with a group_size given, one group size)."""
    from zoo.moe.quantized import PackedStacks

    schemes: dict = {}  # (bits, group size or None) -> the first part quantized so
    for i, moe in layers:
        if isinstance(moe.experts, PackedStacks):
            bits = moe.experts.bits[0]
            for proj in moe.experts.shapes:
                group = None if bits == 8 else moe.experts.group_of(proj)
                schemes.setdefault((bits, group), f"layer {i}'s experts ({proj})")
    for name, linear in linears.items():
        schemes.setdefault((linear.bits, None if linear.bits == 8 else linear.group_size), name)
    if len(schemes) > 1:
        (a_bits, a_group), a = next(iter(schemes.items()))
        (b_bits, b_group), b = next((k, v) for k, v in schemes.items() if k[0] != a_bits or k[1] != a_group)
        if a_bits != b_bits:
            raise NotCompressedTensorsExportable(
                f"{a} is {a_bits}-bit but {b} is {b_bits}-bit: the checkpoint holds one scheme, W8A16 or W4A16, for "
                "every quantized matrix; quantize at one width (allocation='uniform'; a linear layer with no 4-bit "
                "layout stays at 8 bits, so bits=8 there), or export to GGUF (format='gguf')")
        raise NotCompressedTensorsExportable(
            f"{a} has groups of {a_group} but {b} of {b_group}: the checkpoint's one W4A16 scheme has one group "
            "size; quantize with a group_size that divides every width")
    [(bits, group)] = schemes
    return dict(W8A16) if bits == 8 else w4a16(group)


def check_experts(i: int, moe) -> None:
    from zoo.moe.experts import MLPExperts, SwiGLUExperts
    from zoo.moe.quantized import QuantizedExperts, QuantizedMLPExperts

    experts = moe.experts
    if moe.expert_map is not None:
        raise NotCompressedTensorsExportable(
            f"layer {i} serves its router's {moe.router.num_experts} experts with {moe.num_experts} merged ones (an "
            "expert map): a checkpoint holds one expert per router row; export natively (zoo.export expands the map)")
    if type(experts) in (SwiGLUExperts, MLPExperts):
        return
    if type(experts) not in (QuantizedExperts, QuantizedMLPExperts):
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
            f"layer {i} has {widths[0]}-bit experts: vLLM's compressed-tensors kernels (WNA16) read 4 and 8 bits; "
            f"{INSTEAD_LOW}")
    if widths[0] == 4 and not all(zero_is_zero(experts.stored(p, 4)[1]) for p in experts.shapes):
        raise NotCompressedTensorsExportable(f"layer {i} has {widths[0]}-bit experts, {ASYMMETRIC}; {INSTEAD}")
    if getattr(experts, "gate_up_proj_bias", None) is not None or getattr(experts, "down_proj_bias", None) is not None:
        raise NotCompressedTensorsExportable(
            f"layer {i}: quantized experts with biases (GPT-OSS's, whose checkpoint keeps its experts fused): "
            "compressed-tensors quantizes Linear layers, and transformers rebuilds quantized experts from per-expert "
            "weights without biases")


# ------------------------------------------------------------------------------------------------- native names

def native_skeleton(model):
    """(family, native config, the native model on the meta device) for a quantized zoo model, its layout read as
    the dense layout the quantized parts stand for."""
    from zoo.architectures.lookup import family_of
    from zoo.moe.layout import moe_layers, read_layout
    from zoo.moe.quantized import PackedStacks, QuantizedMLPExperts

    fam = family_of(model)
    layout = read_layout(model)
    for i, moe in moe_layers(model):
        if isinstance(moe.experts, PackedStacks):
            entry = copy.deepcopy(layout[i])
            entry["experts"] = "mlp" if isinstance(moe.experts, QuantizedMLPExperts) else "swiglu"
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


def int4_codes(packed: torch.Tensor, scale_zero: torch.Tensor, shape, group_size: int) -> tuple:
    """(int8 codes ``[N, K]`` in -8..7, float32 scales ``[N, K/g]``) of one symmetric int4 matrix in torch's CPU
    int4 pack: the codes read back from the exact weight ``q s`` it stands for (the zoo's C++ dequantiser where it
    is built, else the reference ``dequantize``), and checked to give that weight again bit for bit."""
    from zoo.moe import kernels
    from zoo.moe.quantized import dequantize

    n, k = shape
    if kernels.load():
        w = kernels.dequantize_int4(packed, scale_zero, group_size, torch.float32)
    else:
        w = dequantize(4, packed, scale_zero, shape, group_size)
    w = w.reshape(n, k // group_size, group_size)
    scale = scale_zero.float()[..., 0].t().contiguous()  # [N, K/g]: the bf16 scales, exactly
    q = (w / scale[..., None]).round_()
    if not (torch.equal(q * scale[..., None], w) and q.min() >= -8 and q.max() <= 7):
        raise NotCompressedTensorsExportable("int4 codes could not be read back exactly as w = q s")
    return q.to(torch.int8).view(n, k), scale


def matrix_codes(bits: int, stored: torch.Tensor, scale: torch.Tensor, shape, group_size: int) -> tuple:
    """(int8 codes ``[.., N, K]``, float32 scales ``[.., N, 1]`` (int8) or ``[.., N, K/g]`` (int4)) of one matrix or
    a stack of them, as compressed-tensors holds them."""
    if bits == 8:
        return stored, scale.float()[..., None]
    if stored.dim() == 2:
        return int4_codes(stored, scale, shape, group_size)
    codes, scales = zip(*(int4_codes(w, s, shape, group_size) for w, s in zip(stored, scale)))
    return torch.stack(codes), torch.stack(scales)


def zoo_tensors(model) -> tuple[dict, dict]:
    """The state dict under the zoo's names with the int8 codes ``[.., N, K]`` in place of each quantized matrix (a
    linear layer's ``X.weight``, a layer's ``experts.gate_up_proj`` / ``experts.down_proj`` stacks), and their
    scales (``matrix_codes``) under the same keys, so renames and the per-expert split move both alike."""
    from zoo.moe.layout import block_prefix, moe_layers
    from zoo.moe.quantized import PackedStacks
    from zoo.moe.quantized_linear import QuantizedLinear

    stored, codes, scales = set(), {}, {}
    for name, linear in model.named_modules():
        if isinstance(linear, QuantizedLinear):
            stored |= {f"{name}.{b}" for b, _ in linear.named_buffers(recurse=False)}
            if kept_float(name):
                codes[f"{name}.weight"] = scales[f"{name}.weight"] = linear.dequantized()
                continue
            codes[f"{name}.weight"], scales[f"{name}.weight"] = matrix_codes(
                linear.bits, *linear.packed, (linear.out_features, linear.in_features), linear.group_size)
    for i, moe in moe_layers(model):
        if isinstance(moe.experts, PackedStacks):
            prefix = f"{block_prefix(model, i)}experts."
            stored |= {prefix + b for b, _ in moe.experts.named_buffers(recurse=False)}
            ex, bits = moe.experts, moe.experts.bits[0]
            for proj in ex.shapes:
                codes[f"{prefix}{proj}_proj"], scales[f"{prefix}{proj}_proj"] = matrix_codes(
                    bits, *ex.stored(proj, bits), ex.shapes[proj], ex.group_of(proj))
    main = {k: v for k, v in model.state_dict().items() if k not in stored}
    odd = [k for k, v in main.items() if v.dtype == torch.int8]
    if odd:  # int8 marks the quantized matrices from here on
        raise NotCompressedTensorsExportable(f"{odd[0]} is an int8 tensor outside the quantize compressor's modules")
    return {**main, **codes}, {**main, **scales}


def native_state(model, fam, sd: dict) -> dict:
    """A zoo-named state dict under the native model's names: MoE blocks through the family's own renames, as
    ``zoo.export`` writes them."""
    from zoo.moe.layout import block_prefix, moe_layers

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


def compressed_state(codes: dict, scales: dict, weights: dict = W8A16) -> dict:
    """Checkpoint-named state dicts as compressed-tensors stores them: each int8 ``X.weight`` (codes of the
    ``weights`` scheme) becomes ``X.weight_packed`` / ``X.weight_scale`` / ``X.weight_shape``; float tensors stay
    as they are."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    out = {}
    for key, q in codes.items():
        if q.dtype != torch.int8:
            out[key] = q
            continue
        scale = scales[key]
        groups = 1 if weights["strategy"] == "channel" or q.dim() != 2 else q.shape[1] // weights["group_size"]
        if not key.endswith(".weight") or q.dim() != 2 or tuple(scale.shape) != (q.shape[0], groups):
            raise NotCompressedTensorsExportable(
                f"{key}: the family's checkpoint does not store this matrix as a Linear weight [out, in] (its experts "
                f"stay fused, shape {tuple(q.shape)}): compressed-tensors quantizes Linear layers")
        module = key.removesuffix(".weight")
        out[f"{module}.weight_packed"] = pack_to_int32(q.contiguous(), weights["num_bits"])
        out[f"{module}.weight_scale"] = scale.contiguous()  # float32: the zoo's scales exactly
        out[f"{module}.weight_shape"] = torch.tensor(list(q.shape))
    return out


# ------------------------------------------------------------------------------------------------- the config

def quantization_config(ignore: list[str], weights: dict = W8A16) -> dict:
    """config.json's ``quantization_config``, validated by compressed-tensors' own model: ``weights`` (W8A16 or
    W4A16) targeting ``Linear`` as llm-compressor writes it (what vLLM's fused-MoE layers and transformers' expert
    loader look for), ``ignore`` naming the float linear layers."""
    from compressed_tensors.quantization import QuantizationConfig

    group = {"targets": ["Linear"], "weights": weights, "format": "pack-quantized"}
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
    quantized to int8 or to symmetric int4) to the folder ``path`` as a compressed-tensors checkpoint of its native
    family, with the tokenizer of the folder it came from; refused (``NotCompressedTensorsExportable``, nothing
    written) where the format has no exact form for a part. The folder appears complete or not at all
    (``zoo.io.atomic``)."""
    from transformers.core_model_loading import revert_weight_conversion

    from zoo.io.atomic import atomic_directory
    from zoo.io.loading import copy_side_files
    from zoo.io.outputs import check_output_apart
    from zoo.moe.quantized_linear import QuantizedLinear

    check_output_apart(path, model, what="the export")
    weights = check_model(model)
    fam, native_cfg, native = native_skeleton(model)
    codes, scales = (native_state(model, fam, sd) for sd in zoo_tensors(model))
    check_native_keys(native, codes)
    quantized = {k for k, v in codes.items() if v.dtype == torch.int8}
    tied = getattr(native_cfg.get_text_config(), "tie_word_embeddings", False)
    if tied and isinstance(getattr(model, "lm_head", None), QuantizedLinear):
        raise NotCompressedTensorsExportable("the LM head is quantized but tied to the float input embeddings")
    tensors = compressed_state(revert_weight_conversion(native, codes), revert_weight_conversion(native, scales),
                               weights)
    if tied:
        tensors.pop("lm_head.weight", None)  # transformers ties it to the embeddings on load
    floats = {n for n, m in native.named_modules() if isinstance(m, torch.nn.Linear) and f"{n}.weight" not in quantized}
    native_cfg.quantization_config = quantization_config(sorted(checkpoint_names(native, floats)), weights)
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
