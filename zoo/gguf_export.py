"""GGUF export: a zoo model, or a native checkpoint folder, as one GGUF file that llama.cpp and Ollama load.

Written with the ``gguf`` package (maintained by llama.cpp): its tensor-name map, metadata keys, block formats
and writer. Tensors go to the file one at a time (a spooled temporary file, so the peak is one tensor beside the
model), and a folder is read tensor by tensor from its shards: a checkpoint larger than memory exports.

What maps where:
  * families: Mixtral, Mistral and Llama (llama.cpp's ``llama`` architecture, with experts for Mixtral) and
    Qwen3-MoE (``qwen3moe``); softmax top-k routing renormalised over the chosen experts, as llama.cpp runs it.
    Query and key rows are reordered for the ``llama`` architecture, whose rotary embedding pairs neighbouring
    dimensions where transformers rotates the two halves of a head.
  * float weights keep their precision (bf16 -> BF16, fp32 -> F32, fp16 -> F16); norms and routers are F32.
  * the zoo's quantized experts keep their codes: int8 (one scale per output row) -> Q8_0 blocks of 32 with that
    row's scale as the block scale, rounded to fp16; 4-bit groups (asymmetric: ``w = (q - 8) s + z``) -> Q4_1
    blocks of 32 with ``d = s`` and ``m = z - 8 s`` rounded to fp16, a group of g being g/32 blocks; 2- and 3-bit
    codes fit Q4_1's 0..15 and go the same way (GGUF has no block format with their layout). The only change is
    that fp16 rounding of the scales: ``report`` says by how much.
  * quantized linear layers (``quantize(targets="all")``: attention projections, the LM head) go the same way.
  * uniform layouts only: every expert of a layer the same width, routers llama.cpp computes.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

ARCHS = {"mixtral": "llama", "mistral": "llama", "llama": "llama", "qwen3_moe": "qwen3moe"}
PERMUTED = ("llama",)  # architectures whose rotary embedding interleaves pairs (q/k rows reordered)
QK = 32  # GGUF's block length for Q8_0 and Q4_1


class NotGGUFExportable(ValueError):
    """The model has a layout llama.cpp does not run (the message says which part)."""


@dataclass
class Report:
    """What the export did: per GGUF type the tensors written, and the largest change the fp16 rounding of
    the quantized experts' scales made to a weight (absolute, and relative to that tensor's largest weight)."""
    path: str
    types: dict = field(default_factory=dict)
    max_abs_change: float = 0.0
    max_rel_change: float = 0.0

    def note(self, kind: str, change: torch.Tensor | None = None, scale: float = 1.0) -> None:
        self.types[kind] = self.types.get(kind, 0) + 1
        if change is not None and change.numel():
            worst = float(change.abs().max())
            self.max_abs_change = max(self.max_abs_change, worst)
            self.max_rel_change = max(self.max_rel_change, worst / max(scale, 1e-30))


# ------------------------------------------------------------------------------------------------ block formats

def q8_0_blocks(codes: torch.Tensor, scale: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """int8 codes ``[..., N, K]`` with one scale per row ``[..., N]`` as Q8_0 bytes ``[..., N, K/32*34]``, and
    the weights those bytes stand for (the row scale rounded to fp16)."""
    *lead, n, k = codes.shape
    d = scale.to(torch.float16)
    blocks = codes.reshape(*lead, n, k // QK, QK)
    d_bytes = d[..., None].expand(*lead, n, k // QK).contiguous().view(torch.uint8).reshape(*lead, n, k // QK, 2)
    out = torch.cat([d_bytes, blocks.view(torch.uint8)], -1).reshape(*lead, n, k // QK * (QK + 2))
    return out.numpy(), codes.float() * d.float()[..., None]


def q4_1_blocks(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """Codes in 0..15 ``[..., N, K]`` with per-group ``w = codes * scale + low`` (``scale``, ``low``:
    ``[..., N, K/g]``) as Q4_1 bytes ``[..., N, K/32*20]``, and the weights those bytes stand for."""
    *lead, n, k = codes.shape
    per = k // scale.shape[-1] // QK  # Q4_1 blocks per group
    d = scale.to(torch.float16).repeat_interleave(per, -1)
    m = low.to(torch.float16).repeat_interleave(per, -1)
    q = codes.to(torch.uint8).reshape(*lead, n, k // QK, QK)
    packed = q[..., :QK // 2] | (q[..., QK // 2:] << 4)  # byte j: element j (low nibble), element j + 16 (high)
    dm = torch.stack([d, m], -1).contiguous().view(torch.uint8).reshape(*lead, n, k // QK, 4)
    out = torch.cat([dm, packed], -1).reshape(*lead, n, k // QK * (4 + QK // 2))
    stands_for = q.float() * d.float()[..., None] + m.float()[..., None]
    return out.numpy(), stands_for.reshape(*lead, n, k)


def _dequantized(bits, q, scale, shape, group_size) -> torch.Tensor:
    """The float weight of a stored matrix: int4 through the zoo's C++ dequantiser where it is built (the reference
    ``dequantize`` reads torch's int4 pack by multiplying the identity: minutes for the 304M model's experts)."""
    from zoo import kernels
    from zoo.moe.quantized import dequantize

    if bits == 4 and kernels.load():
        return kernels.dequantize_int4(q, scale, group_size, torch.float32).contiguous()
    return dequantize(bits, q, scale, shape, group_size)


def matrix_codes(bits: int, stored: torch.Tensor, scale: torch.Tensor, n: int, k: int, group_size: int):
    """Stacked quantized matrices of one width ``[E, ...]`` as GGUF sees them: (GGUF type, codes ``[E, N, K]``,
    scale, low (None for int8), the zoo's dequantized weights ``[E, N, K]``)."""
    from zoo.moe.packing import unpack

    ref = torch.stack([_dequantized(bits, stored[e], scale[e], (n, k), group_size) for e in range(len(stored))])
    if bits == 8:
        return "Q8_0", stored, scale.float(), None, ref
    s, z = scale.float()[..., 0].transpose(1, 2), scale.float()[..., 1].transpose(1, 2)  # [E, N, K/g]
    low = z - 8 * s
    if bits in (2, 3):
        codes = torch.stack([unpack(w, bits, k) for w in stored])
    else:  # torch's int4 pack: the codes back from the exact dequantized weights
        g = group_size
        codes = ((ref.view(-1, n, k // g, g) - low[..., None]) / s[..., None]).round().clamp(0, 15).view(-1, n, k)
        again = (codes.view(-1, n, k // g, g) * s[..., None] + low[..., None]).view(-1, n, k)
        if not torch.allclose(again, ref, rtol=0, atol=1e-6 * float(ref.abs().max())):
            raise NotGGUFExportable("int4 codes could not be read back exactly")
    return "Q4_1", codes.to(torch.int32), s, low, ref


def expert_codes(experts, proj: str):
    """One projection of a uniform-width quantized expert stack (``matrix_codes``' tuple)."""
    bits = experts.bits[0]
    stored, scale = experts.stored(proj, bits)
    return matrix_codes(bits, stored, scale, *experts.shapes[proj], experts.group_of(proj))


def linear_codes(linear):
    """A quantized linear layer as one matrix (``matrix_codes``' tuple, without the stack dimension)."""
    q, s = linear.packed
    kind, codes, scale, low, ref = matrix_codes(linear.bits, q[None], s[None], linear.out_features,
                                                linear.in_features, linear.group_size)
    return kind, codes[0], scale[0], None if low is None else low[0], ref[0]


def quantized_blocks(kind: str, codes, scale, low) -> tuple[np.ndarray, torch.Tensor]:
    return q8_0_blocks(codes, scale) if kind == "Q8_0" else q4_1_blocks(codes, scale, low)


# ----------------------------------------------------------------------------------------------- the sources

def model_tensors(model):
    """(native name, tensor or quantized module) of an in-memory zoo or native model, layer by layer. A quantized
    expert stack comes as ``("...experts", QuantizedExperts)`` under the layer's ``mlp.experts`` name, a quantized
    linear layer as ``("....weight", QuantizedLinear)``."""
    from zoo.layout import block_prefix, moe_layers
    from zoo.moe.quantized import QuantizedExperts
    from zoo.moe.quantized_linear import QuantizedLinear

    moe = {block_prefix(model, i): block for i, block in moe_layers(model)}
    quantized = {f"{name}.": m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    for name, tensor in model.state_dict().items():
        prefix = next((p for p in moe if name.startswith(p)), None)
        owner = next((p for p in quantized if name.startswith(p)), None)
        if owner is not None:
            if name == owner + "bias":
                yield name, tensor
            elif name in (owner + "weight_int8", owner + "weight_int4"):
                yield owner + "weight", quantized[owner]
        elif prefix is None:
            yield name, tensor
    for prefix, block in moe.items():
        check_moe(block, prefix)
        yield prefix + "gate.weight", block.router.weight
        if isinstance(block.experts, QuantizedExperts):
            yield prefix + "experts", block.experts
        else:
            yield prefix + "experts.gate_up_proj", block.experts.gate_up_proj
            yield prefix + "experts.down_proj", block.experts.down_proj


def check_moe(block, where: str) -> None:
    """llama.cpp runs softmax top-k routing over plain (or uniformly quantized) SwiGLU experts."""
    from zoo.moe.experts import SwiGLUExperts
    from zoo.moe.quantized import QuantizedExperts

    router = type(block.router).__name__
    if getattr(block.router, "name", "") != "topk-softmax" or getattr(block.router, "bias", None) is not None:
        raise NotGGUFExportable(f"{where}: llama.cpp runs softmax top-k routing; this layer's router is {router} "
                                f"({getattr(block.router, 'name', '?')})")
    if getattr(block.router, "serving_map", None) is not None:
        raise NotGGUFExportable(f"{where}: the router maps several rows to one expert (hc-smoe's expert map); "
                                "export it natively (zoo.export expands the map), then to GGUF from that folder")
    if getattr(block, "shared_experts", None) is not None:
        raise NotGGUFExportable(f"{where}: a shared expert has no place in llama.cpp's llama/qwen3moe layers")
    experts = block.experts
    if isinstance(experts, QuantizedExperts):
        if len(set(experts.bits)) > 1:
            raise NotGGUFExportable(f"{where}: experts of mixed widths {sorted(set(experts.bits))} (one GGUF tensor "
                                    "holds every expert of a layer, in one type): quantize with allocation='uniform'")
        if experts.gate_up_proj_bias is not None or experts.down_proj_bias is not None:
            raise NotGGUFExportable(f"{where}: experts with biases")
    elif type(experts) is not SwiGLUExperts or experts.activation != "silu":
        raise NotGGUFExportable(f"{where}: {type(experts).__name__} experts ({getattr(experts, 'name', '?')}) have no "
                                "GGUF form (plain or quantized SwiGLU experts only)")


def folder_tensors(folder: Path):
    """(name, tensor) of a native checkpoint folder, read one tensor at a time from its safetensors shards through
    the zoo's one reader (``zoo.checkpoint.read_checked``: dtype, shape and bounds against the header, finite)."""
    from zoo.checkpoint import checked_weight_map, read_checked

    files = checked_weight_map(folder)
    for name, file in sorted(files.items(), key=lambda kv: (kv[1], kv[0])):
        yield name, read_checked(file, name)


# ----------------------------------------------------------------------------------------------- the writer

def check_target_file(path) -> Path:
    """A GGUF file is written at ``path`` only where nothing is: its folder exists and ``path`` does not, not even as
    a symbolic link (an export never replaces a file: ``zoo.atomic.check_new_file``)."""
    from zoo.atomic import check_new_file

    return check_new_file(path)


def native_folder(source: str) -> str | None:
    """The local folder of ``source`` (a folder, registry name or hub id) when it holds a native checkpoint of a
    family GGUF export maps, which is then read tensor by tensor; None when the model must be loaded."""
    from transformers import AutoConfig

    from zoo.loading import resolve_path

    folder = resolve_path(source)
    if not os.path.isdir(folder):
        return None
    config = AutoConfig.from_pretrained(folder)
    return folder if config.model_type in ARCHS else None


def permute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a query/key projection from transformers' half rotation to llama.cpp's pairwise rotation: in each
    head, row ``j`` of the first half and row ``j`` of the second half become rows ``2j`` and ``2j + 1``."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def float_array(t: torch.Tensor, keep: bool = True) -> tuple[np.ndarray, object]:
    """A float tensor as numpy and its GGUF type: bf16 as BF16 (raw bytes), fp16 as F16, else F32."""
    import gguf

    t = t.detach().cpu().contiguous()
    if keep and t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16), gguf.GGMLQuantizationType.BF16
    if keep and t.dtype == torch.float16:
        return t.numpy(), gguf.GGMLQuantizationType.F16
    return t.float().numpy(), gguf.GGMLQuantizationType.F32


def check_config(config) -> str:
    arch = ARCHS.get(config.model_type.removeprefix("zoo_"))
    if arch is None:
        raise NotGGUFExportable(f"GGUF export covers {', '.join(sorted(ARCHS))} models, got {config.model_type}")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise NotGGUFExportable(f"rope_type {rope.get('rope_type')!r}: only the default rotary embedding is mapped")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise NotGGUFExportable(f"hidden_act {config.hidden_act!r}: llama.cpp's layers here are SwiGLU")
    if config.model_type.removeprefix("zoo_") == "qwen3_moe":
        if not getattr(config, "norm_topk_prob", True):
            raise NotGGUFExportable("norm_topk_prob=False: llama.cpp's qwen3moe renormalises the top-k weights")
        if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1:
            raise NotGGUFExportable("dense layers inside a Qwen3-MoE (mlp_only_layers / decoder_sparse_step)")
    return arch


def write_metadata(writer, config, arch: str, experts: int | None, expert_ffn: int | None,
                   used: int | None = None) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_name(os.path.basename(str(getattr(config, "name_or_path", "") or "moe-zoo model")) or "moe-zoo model")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = getattr(config, "rope_parameters", None) or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(used or config.num_experts_per_tok)
        writer.add_feed_forward_length(getattr(config, "intermediate_size", expert_ffn))
        writer.add_expert_feed_forward_length(expert_ffn)
    else:
        writer.add_feed_forward_length(config.intermediate_size)


def read_tokenizer(folder: Path | None, vocab: int):
    """(tokens, types, folder) of the GPT-2-style byte-level BPE tokenizer of ``folder``, padded to the ``vocab`` rows of
    the embedding; None when there is none. A tokenizer with more tokens than the embedding has rows is refused
    (llama.cpp would index past the embedding)."""
    import gguf

    if folder is None or not (folder / "tokenizer.json").is_file():
        return None
    try:
        vocab_file = gguf.vocab.BpeVocab(folder)
    except (FileNotFoundError, ValueError):
        return None  # not a byte-level BPE: the file still loads with token ids
    tokens, _scores, types = zip(*vocab_file.all_tokens())
    tokens = [t if isinstance(t, str) else t.decode("utf-8") for t in tokens]
    if len(tokens) > vocab:
        raise NotGGUFExportable(f"the tokenizer in {folder} has {len(tokens)} tokens but the model's embedding has "
                                f"{vocab} rows: it is not this model's tokenizer (save the model's own beside it)")
    pad = vocab - len(tokens)  # the embedding may be larger than the tokenizer
    return tokens + [f"[PAD{i}]" for i in range(pad)], list(types) + [gguf.TokenType.UNUSED] * pad, folder


def write_tokenizer(writer, tokenizer) -> bool:
    """``read_tokenizer``'s tokens, types, merges and special ids into the GGUF metadata."""
    import gguf

    if tokenizer is None:
        return False
    tokens, types, folder = tokenizer
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # llama.cpp's name for the GPT-2 split regex (ByteLevel with use_regex)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
    return True


def _experts_per_token(source, config) -> int | None:
    """The k llama.cpp must use: the routers' own (one for every layer), never more than the experts left."""
    from zoo.layout import moe_layers

    if isinstance(source, torch.nn.Module):
        ks = {int(block.router.top_k) for _, block in moe_layers(source)}
        if len(ks) > 1:
            raise NotGGUFExportable(f"layers route to different numbers of experts {sorted(ks)}: GGUF has one "
                                    "expert_used_count")
        return ks.pop() if ks else None
    return getattr(config, "num_experts_per_tok", None)


def export_gguf(source, path, progress: bool = True) -> Report:
    """Write ``source`` (an in-memory model, or the folder of a native checkpoint) to the GGUF file ``path``, which
    must not exist; the file appears complete or not at all (``zoo.atomic.atomic_file``: staged in a new hidden
    file beside it, never over a user's file or through a link)."""
    import gguf
    from tqdm.auto import tqdm
    from transformers import AutoConfig

    from zoo.atomic import atomic_file

    check_target_file(path)
    if isinstance(source, (str, os.PathLike)):
        folder = Path(source)
        config = AutoConfig.from_pretrained(folder)
        tensors = folder_tensors(folder)
    else:
        config = source.config
        origin = getattr(config, "name_or_path", "")
        folder = Path(origin) if origin and os.path.isdir(origin) else None
        tensors = model_tensors(source)
    arch = check_config(config)
    used = _experts_per_token(source, config)
    tokenizer = read_tokenizer(folder, config.vocab_size)  # refused before any tensor is written
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    expert_ffn = getattr(config, "moe_intermediate_size", None) or getattr(config, "intermediate_size", None)
    tied = getattr(config, "tie_word_embeddings", False)
    report, experts = Report(os.fspath(path)), set()
    with atomic_file(path) as staged:
        writer = gguf.GGUFWriter(staged, arch, use_temp_file=True)
        for name, value in tqdm(tensors, desc="gguf", disable=not progress, unit=" tensors"):
            if name == "lm_head.weight" and tied:
                continue  # llama.cpp reads the output projection from token_embd when there is none
            for gname, array, kind, change, scale in gguf_tensors(name, value, names, arch, config):
                if gname == "token_embd.weight" and array.shape[0] != config.vocab_size:
                    raise NotGGUFExportable(f"{name} has {array.shape[0]} rows but vocab_size is {config.vocab_size}")
                writer.add_tensor(gname, array, raw_dtype=kind)
                report.note(kind.name, change, scale)
                if gname.endswith("ffn_gate_inp.weight"):
                    experts.add(array.shape[0])  # after pruning, fewer than the config says
        if len(experts) > 1:
            raise NotGGUFExportable(f"layers hold different numbers of experts {sorted(experts)}: GGUF has one "
                                    "expert_count")
        count = experts.pop() if experts else None
        if count is not None and used is not None and used > count:
            raise NotGGUFExportable(f"the router picks {used} experts per token but layers hold {count}: llama.cpp "
                                    f"would read past them (set num_experts_per_tok <= {count})")
        write_metadata(writer, config, arch, count, expert_ffn, used)
        write_tokenizer(writer, tokenizer)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if "BF16" in report.types else gguf.LlamaFileType.ALL_F32)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=False)
        writer.close()
    return report


def gguf_tensors(name: str, value, names, arch: str, config):
    """(GGUF name, array, GGUF type, change, scale) for one native tensor (two for a fused gate/up stack)."""
    import gguf

    T = gguf.GGMLQuantizationType
    layer = name.split(".")[2] if name.startswith("model.layers.") else None
    if isinstance(value, torch.Tensor) and name.endswith("experts.gate_up_proj"):
        inter = value.shape[1] // 2
        for part, rows in (("FFN_GATE_EXP", slice(0, inter)), ("FFN_UP_EXP", slice(inter, None))):
            array, kind = float_array(value[:, rows])
            yield tensor_name(part, layer), array, kind, None, 1.0
        return
    if isinstance(value, torch.Tensor) and name.endswith("experts.down_proj"):
        array, kind = float_array(value)
        yield tensor_name("FFN_DOWN_EXP", layer), array, kind, None, 1.0
        return
    if not isinstance(value, torch.Tensor) and hasattr(value, "packed"):  # a quantized linear layer
        gname = names.get_name(name, try_suffixes=(".weight",))
        if gname is None:
            raise NotGGUFExportable(f"{name}: no GGUF tensor for it in llama.cpp's {arch} architecture")
        kind, codes, s, low, ref = linear_codes(value)
        if arch in PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            codes, s, ref = permute_rope(codes, heads), permute_rope(s, heads), permute_rope(ref, heads)
            low = None if low is None else permute_rope(low, heads)
        data, got = quantized_blocks(kind, codes, s, low)
        yield gname, data, T[kind], got - ref, float(ref.abs().max())
        return
    if not isinstance(value, torch.Tensor):  # a quantized expert stack
        for proj in ("gate_up", "down"):
            kind, codes, s, low, ref = expert_codes(value, proj)
            if proj == "gate_up":
                inter = codes.shape[1] // 2
                parts = (("FFN_GATE_EXP", slice(0, inter)), ("FFN_UP_EXP", slice(inter, None)))
            else:
                parts = (("FFN_DOWN_EXP", slice(None)),)
            for part, rows in parts:
                data, got = quantized_blocks(kind, codes[:, rows], s[:, rows], None if low is None else low[:, rows])
                want = ref[:, rows]
                yield tensor_name(part, layer), data, T[kind], got - want, float(want.abs().max())
        return
    gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
    if gname is None:
        raise NotGGUFExportable(f"{name}: no GGUF tensor for it in llama.cpp's {arch} architecture")
    if arch in PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
        value = permute_rope(value, heads)
    small = value.dim() == 1 or gname.endswith("ffn_gate_inp.weight")  # norms and routers: F32, as llama.cpp keeps them
    array, kind = float_array(value, keep=not small)
    yield gname, array, kind, None, 1.0


def tensor_name(part: str, layer: str) -> str:
    import gguf

    return gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[part]].format(bid=layer) + ".weight"
