"""GGUF export: a zoo model, or a native checkpoint folder, as one GGUF file that llama.cpp and Ollama load.

Written with the ``gguf`` package (maintained by llama.cpp): its tensor-name map, metadata keys, block formats
and writer. Tensors go to the file one at a time (a spooled temporary file, so the peak is one tensor beside the
model), and a folder is read tensor by tensor from its shards: a checkpoint larger than memory exports.

What maps where (the family -> llama.cpp's architecture, and what that architecture computes):
  * Mixtral, Mistral and Llama -> ``llama`` (with experts for Mixtral), Qwen3-MoE -> ``qwen3moe``: softmax top-k
    routing renormalised over the chosen experts. Query and key rows are reordered for the ``llama`` architecture,
    whose rotary embedding pairs neighbouring dimensions where transformers rotates the two halves of a head.
  * Qwen2-MoE -> ``qwen2moe``: softmax top-k *not* renormalised (norm_topk_prob=False), plus the shared expert
    scaled by its sigmoid gate (``ffn_gate_inp_shexp``); every layer MoE (llama.cpp's qwen2moe has no dense
    layer); query/key/value biases (zeros written where the model has none: llama.cpp requires them).
  * OLMoE -> ``olmoe``: softmax top-k not renormalised; RMSNorm over the whole query and key projections, so as
    many key/value heads as query heads (llama.cpp sizes both norms by the hidden size).
  * DeepSeek-V3 -> ``deepseek2``: sigmoid affinities, the selection bias (``exp_probs_b``), group-limited top-k
    (``expert_group_count``/``expert_group_used_count``, groups scored by their two best experts), renormalisation
    and ``routed_scaling_factor`` (``expert_weights_norm``/``expert_weights_scale``), shared experts, the
    ``first_k_dense_replace`` leading dense layers (``leading_dense_block_count``) and multi-head latent attention
    in llama.cpp's absorbed form: ``kv_b_proj`` split per head into ``attn_k_b`` (transposed) and ``attn_v_b``.
    Rotary rows are reordered when the checkpoint is not interleaved (``rope_interleave=False``).
  * GPT-OSS is refused: llama.cpp's ``gpt-oss`` runs YaRN with its correction range rounded to whole dimensions
    (and fixed SwiGLU clamps); GPT-OSS's YaRN leaves it unrounded (``truncate=False``), so llama.cpp would compute
    other logits.
  * float weights keep their precision (bf16 -> BF16, fp32 -> F32, fp16 -> F16); norms, routers, biases F32.
  * the zoo's quantized experts keep their codes: int8 (one scale per output row) -> Q8_0 blocks of 32 with that
    row's scale as the block scale, rounded to fp16; 4-bit groups (asymmetric: ``w = (q - 8) s + z``) -> Q4_1
    blocks of 32 with ``d = s`` and ``m = z - 8 s`` rounded to fp16, a group of g being g/32 blocks; 2- and 3-bit
    codes fit Q4_1's 0..15 and go the same way (GGUF has no block format with their layout). The only change is
    that fp16 rounding of the scales: ``report`` says by how much.
  * quantized linear layers (``quantize(targets="all")``: attention projections, shared experts, the LM head) go
    the same way, except DeepSeek's ``kv_b_proj`` (llama.cpp wants it transposed per head; blocks do not transpose).
  * uniform layouts only: every expert of a layer the same width, one routing for all layers, routers llama.cpp
    computes; anything else is refused with ``NotGGUFExportable`` naming the part, before a file appears.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

ARCHS = {"mixtral": "llama", "mistral": "llama", "llama": "llama", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe",
         "olmoe": "olmoe", "deepseek_v3": "deepseek2"}
# native folders read tensor by tensor (transformers' fused expert stacks); other families' folders are loaded
STREAMED = ("mixtral", "mistral", "llama", "qwen3_moe")
PERMUTED = ("llama",)  # architectures whose rotary embedding interleaves pairs (q/k rows reordered)
OUTPUT_REQUIRED = ("qwen2moe", "olmoe", "deepseek2")  # loaders without a tied-embedding fallback: output.weight
QK = 32  # GGUF's block length for Q8_0 and Q4_1


@dataclass(frozen=True)
class MoESpec:
    """What llama.cpp's MoE layer of one architecture computes: the zoo router with its gating, whether the kept
    weights are renormalised (None: the file says, ``expert_weights_norm``) and the shared expert it adds (None,
    "gated": Qwen2-MoE's, scaled by a sigmoid gate, "plain": DeepSeek's)."""
    router: str
    norm: bool | None
    shared: str | None = None


MOE = {"llama": MoESpec("topk-softmax", True), "qwen3moe": MoESpec("topk-softmax", True),
       "qwen2moe": MoESpec("topk-softmax", False, "gated"), "olmoe": MoESpec("topk-softmax", False),
       "deepseek2": MoESpec("sigmoid-bias", None, "plain")}
GATING = {"topk-softmax": "softmax top-k routing", "sigmoid-bias": "DeepSeek's sigmoid routing with a selection bias"}


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
    if codes.shape[-1] % QK:
        raise NotGGUFExportable(f"quantized rows of {codes.shape[-1]} weights: {kind} blocks hold {QK} (rows must be "
                                f"a multiple of {QK})")
    return q8_0_blocks(codes, scale) if kind == "Q8_0" else q4_1_blocks(codes, scale, low)


# ----------------------------------------------------------------------------------------------- the sources

def model_tensors(model, arch: str = "llama"):
    """(native name, tensor or quantized module) of an in-memory zoo or native model, layer by layer. A quantized
    expert stack comes as ``("...experts", QuantizedExperts)`` under the layer's ``mlp.experts`` name, a quantized
    linear layer as ``("....weight", QuantizedLinear)``. Each MoE block is checked against llama.cpp's ``arch``
    layer before its tensors come."""
    from zoo.layout import block_prefix, moe_layers
    from zoo.moe.quantized_linear import QuantizedLinear

    moe = {block_prefix(model, i): block for i, block in moe_layers(model)}
    quantized = {f"{name}.": m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    for name, tensor in model.state_dict().items():
        if any(name.startswith(p) for p in moe):
            continue  # the block's tensors come below, after its check
        owner = next((p for p in quantized if name.startswith(p)), None)
        if owner is not None:
            if name == owner + "bias":
                yield name, tensor
            elif name in (owner + "weight_int8", owner + "weight_int4"):
                yield owner + "weight", quantized[owner]
        else:
            yield name, tensor
    for prefix, block in moe.items():
        check_moe(block, prefix, arch)
        yield from block_tensors(block, prefix)


def block_tensors(block, prefix: str):
    """(native name, tensor or quantized module) of one SparseMoE (checked): router, experts, shared expert."""
    from zoo.moe.quantized import QuantizedExperts
    from zoo.moe.quantized_linear import QuantizedLinear

    yield prefix + "gate.weight", block.router.weight
    if isinstance(getattr(block.router, "e_score_correction_bias", None), torch.Tensor):  # DeepSeek's selection bias
        yield prefix + "gate.e_score_correction_bias", block.router.e_score_correction_bias
    if isinstance(block.experts, QuantizedExperts):
        yield prefix + "experts", block.experts
    else:
        yield prefix + "experts.gate_up_proj", block.experts.gate_up_proj
        yield prefix + "experts.down_proj", block.experts.down_proj
    shared = block.shared_experts
    if shared is not None:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            linear = getattr(shared, proj)
            yield f"{prefix}shared_experts.{proj}.weight", linear if isinstance(linear, QuantizedLinear) else \
                linear.weight
        if shared.gate is not None:
            yield prefix + "shared_expert_gate.weight", shared.gate.weight


def check_moe(block, where: str, arch: str = "llama") -> None:
    """The layer computes what llama.cpp's ``arch`` MoE layer computes: its gating (renormalisation and expert groups
    are checked once for all layers, ``check_routing``), its shared expert and plain (or uniformly quantized) SwiGLU
    experts."""
    from zoo.moe.experts import SwiGLUExperts
    from zoo.moe.quantized import QuantizedExperts

    spec = MOE[arch]
    router = type(block.router).__name__
    if getattr(block.router, "name", "") != spec.router or getattr(block.router, "bias", None) is not None:
        raise NotGGUFExportable(f"{where}: llama.cpp's {arch} layers run {GATING[spec.router]}; this layer's router "
                                f"is {router} ({getattr(block.router, 'name', '?')})")
    if getattr(block.router, "serving_map", None) is not None:
        raise NotGGUFExportable(f"{where}: the router maps several rows to one expert (hc-smoe's expert map); "
                                "export it natively (zoo.export expands the map), then to GGUF from that folder")
    check_shared(getattr(block, "shared_experts", None), where, arch)
    experts = block.experts
    if isinstance(experts, QuantizedExperts):
        if len(set(experts.bits)) > 1:
            raise NotGGUFExportable(f"{where}: experts of mixed widths {sorted(set(experts.bits))} (one GGUF tensor "
                                    "holds every expert of a layer, in one type): quantize with allocation='uniform'")
        if experts.gate_up_proj_bias is not None or experts.down_proj_bias is not None:
            raise NotGGUFExportable(f"{where}: experts with biases")
    elif type(experts) is not SwiGLUExperts or experts.activation != "silu" or experts.gate_up_proj_bias is not None:
        raise NotGGUFExportable(f"{where}: {type(experts).__name__} experts ({getattr(experts, 'name', '?')}) have no "
                                "GGUF form (plain or quantized SwiGLU experts only)")


def check_shared(shared, where: str, arch: str) -> None:
    """The shared expert is the one llama.cpp's ``arch`` layer adds: a SiLU SwiGLU MLP, sigmoid-gated for qwen2moe."""
    from zoo.moe.block import SharedMLP

    want = MOE[arch].shared
    if want is None:
        if shared is not None:
            raise NotGGUFExportable(f"{where}: a shared expert has no place in llama.cpp's {arch} layers")
        return
    if shared is None:
        raise NotGGUFExportable(f"{where}: llama.cpp's {arch} layers add a shared expert; this layer has none")
    plain = type(shared) is SharedMLP and shared.gate_proj is not None and shared.activation == "silu" \
        and shared.scale == 1.0
    if not plain or (shared.gate is not None) != (want == "gated"):
        gate = "with" if want == "gated" else "without"
        raise NotGGUFExportable(f"{where}: llama.cpp's {arch} shared expert is a SiLU SwiGLU MLP {gate} a sigmoid "
                                f"gate; this layer's is {type(shared).__name__} ({getattr(shared, 'options', dict)()})")


# a checkpoint that stores each expert apart, as transformers writes Mixtral (w1 gate, w3 up, w2 down) and Qwen3-MoE
PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<part>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
GATE, UP = ("w1", "gate_proj"), ("w3", "up_proj")


def folder_tensors(folder: Path):
    """(name, tensor) of a native checkpoint folder, read one tensor at a time from its safetensors shards through
    the zoo's one reader (``zoo.checkpoint.read_checked``: dtype, shape and bounds against the header, finite). Experts
    stored apart are stacked per layer as transformers stacks them (``experts.gate_up_proj [E, 2I, H]``,
    ``experts.down_proj [E, H, I]``), one layer's experts held at a time."""
    from zoo.checkpoint import checked_weight_map, read_checked

    files = checked_weight_map(folder)
    needed: dict[str, int] = {}  # experts prefix -> how many per-expert matrices it has
    for name in files:
        m = PER_EXPERT.match(name)
        if m:
            needed[m["prefix"]] = needed.get(m["prefix"], 0) + 1
    pending: dict[str, dict] = {}
    for name, file in sorted(files.items(), key=lambda kv: (kv[1], kv[0])):
        m = PER_EXPERT.match(name)
        if m is None:
            yield name, read_checked(file, name)
            continue
        parts = pending.setdefault(m["prefix"], {})
        parts[int(m["e"]), m["part"]] = read_checked(file, name)
        if len(parts) == needed[m["prefix"]]:
            yield from _stacked(m["prefix"], pending.pop(m["prefix"]))


def _stacked(prefix: str, parts: dict):
    """A layer's per-expert matrices as the fused ``gate_up_proj`` and ``down_proj`` stacks."""
    experts = sorted({e for e, _ in parts})
    if experts != list(range(len(experts))) or len(parts) != 3 * len(experts):
        raise NotGGUFExportable(f"{prefix}: experts {experts} are not each stored as gate, up and down matrices")
    pick = {e: {("gate" if p in GATE else "up" if p in UP else "down"): t for (i, p), t in parts.items() if i == e}
            for e in experts}
    yield f"{prefix}.gate_up_proj", torch.stack([torch.cat([pick[e]["gate"], pick[e]["up"]]) for e in experts])
    yield f"{prefix}.down_proj", torch.stack([pick[e]["down"] for e in experts])


# ----------------------------------------------------------------------------------------------- the writer

def check_target_file(path) -> Path:
    """A GGUF file is written at ``path`` only where nothing is: its folder exists and ``path`` does not, not even as
    a symbolic link (an export never replaces a file: ``zoo.atomic.check_new_file``)."""
    from zoo.atomic import check_new_file

    return check_new_file(path)


def native_folder(source: str) -> str | None:
    """The local folder of ``source`` (a folder, registry name or hub id) when it holds a native checkpoint of a
    family whose folders GGUF export streams (``STREAMED``) with its experts stored stacked, which is then read
    tensor by tensor; None when the model must be loaded."""
    from transformers import AutoConfig

    from zoo.loading import resolve_path

    folder = resolve_path(source)
    if not os.path.isdir(folder):
        return None
    config = AutoConfig.from_pretrained(folder)
    if config.model_type not in STREAMED:
        return None
    return folder  # (experts stored apart are stacked layer by layer: folder_tensors)


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
    """llama.cpp's architecture for ``config``'s family, or NotGGUFExportable naming what it cannot run."""
    family = config.model_type.removeprefix("zoo_")
    arch = ARCHS.get(family)
    if family == "gpt_oss":
        raise NotGGUFExportable(_gpt_oss_problem(config))
    if arch is None:
        raise NotGGUFExportable(f"GGUF export covers {', '.join(sorted(ARCHS))} models, got {config.model_type}")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise NotGGUFExportable(f"rope_type {rope.get('rope_type')!r}: only the default rotary embedding is mapped")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise NotGGUFExportable(f"hidden_act {config.hidden_act!r}: llama.cpp's layers here are SwiGLU")
    problem = FAMILY_CHECKS.get(family, lambda c: None)(config)
    if problem:
        raise NotGGUFExportable(problem)
    return arch


def _qwen_problem(config) -> str | None:
    family = "Qwen2-MoE" if config.model_type.removeprefix("zoo_") == "qwen2_moe" else "Qwen3-MoE"
    if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1:
        return (f"GGUF export covers {family} with every layer MoE: llama.cpp has no dense layer inside a "
                f"{ARCHS[config.model_type.removeprefix('zoo_')]} model (mlp_only_layers "
                f"{list(getattr(config, 'mlp_only_layers', None) or [])}, decoder_sparse_step "
                f"{getattr(config, 'decoder_sparse_step', 1)})")
    if getattr(config, "use_sliding_window", False):
        return f"use_sliding_window: llama.cpp's {family} layers attend over the whole context"
    return None


def _olmoe_problem(config) -> str | None:
    if config.num_key_value_heads != config.num_attention_heads:
        return (f"GGUF export covers OLMoE with as many key/value heads as query heads: llama.cpp's olmoe sizes the "
                f"key norm by the hidden size (this model: {config.num_key_value_heads} key/value heads, "
                f"{config.num_attention_heads} query heads)")
    if getattr(config, "clip_qkv", None) is not None:
        return f"clip_qkv={config.clip_qkv}: llama.cpp's olmoe does not clamp queries, keys and values"
    if getattr(config, "attention_bias", False):
        return "attention_bias: llama.cpp's olmoe attention has no biases"
    return None


def _deepseek_problem(config) -> str | None:
    if getattr(config, "attention_bias", False):
        return "attention_bias: llama.cpp's deepseek2 attention has no biases"
    lite = config.num_hidden_layers in (26, 27) or (config.num_hidden_layers, config.vocab_size) == (48, 128256)
    if config.q_lora_rank and lite:  # llama.cpp then never reads q_lora_rank
        return (f"q_lora_rank={config.q_lora_rank} with {config.num_hidden_layers} layers: llama.cpp reads such a "
                "deepseek2 as a \"lite\" model (DeepSeek-V2-Lite), without a query LoRA")
    return None


def _gpt_oss_problem(config) -> str:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type") == "yarn" and not rope.get("truncate", True):
        return ("GPT-OSS has no exact GGUF form: llama.cpp's gpt-oss rounds YaRN's correction range to whole "
                "dimensions (ggml_rope_yarn_corr_dims) where this model leaves it unrounded (truncate=False), so "
                "llama.cpp would rotate queries and keys at other frequencies")
    return ("GGUF export does not map GPT-OSS (attention sinks, sliding window, biased clamped-SwiGLU experts) to "
            "llama.cpp's gpt-oss yet")


FAMILY_CHECKS = {"qwen2_moe": _qwen_problem, "qwen3_moe": _qwen_problem, "olmoe": _olmoe_problem,
                 "deepseek_v3": _deepseek_problem}


def moe_blocks(source, config) -> list:
    """(layer, SparseMoE) of the MoE layers: a model's own, or for a zoo folder its ``zoo_layout`` built on the meta
    device (the same checks then read the same modules); [] for a native checkpoint (its family's own blocks)."""
    from zoo.layout import build_block, moe_layers

    if isinstance(source, torch.nn.Module):
        return moe_layers(source)
    with torch.device("meta"):
        return [(i, build_block(entry)) for i, entry in enumerate(getattr(config, "zoo_layout", None) or [])
                if entry]


def routing_facts(blocks: list, config) -> dict:
    """The routing of every MoE layer, which GGUF holds once for all: k, renormalisation, the routed weights' scale
    and DeepSeek's expert groups; read off the routers (``moe_blocks``), else off the config."""
    routers = [block.router for _, block in blocks]
    seen = {(int(r.top_k), bool(getattr(r, "norm_topk_prob", True)), float(getattr(r, "routed_scaling_factor", 1.0)),
             int(getattr(r, "n_group", 1)), int(getattr(r, "topk_group", 1))) for r in routers}
    if not routers:
        seen = {(getattr(config, "num_experts_per_tok", None), bool(getattr(config, "norm_topk_prob", True)),
                 float(getattr(config, "routed_scaling_factor", 1.0)), int(getattr(config, "n_group", None) or 1),
                 int(getattr(config, "topk_group", None) or 1))}
    ks = {k for k, *_ in seen}
    if len(ks) > 1:
        raise NotGGUFExportable(f"layers route to different numbers of experts {sorted(ks)}: GGUF has one "
                                "expert_used_count")
    if len(seen) > 1:
        raise NotGGUFExportable(f"layers route differently (k, norm_topk_prob, routed_scaling_factor, n_group, "
                                f"topk_group: {sorted(seen)}): GGUF holds one routing for all layers")
    top_k, norm, scale, n_group, topk_group = seen.pop()
    return {"top_k": top_k, "norm": norm, "scale": scale, "n_group": n_group, "topk_group": topk_group}


def check_routing(facts: dict, arch: str, experts: int | None = None) -> None:
    """llama.cpp's ``arch`` can hold that routing: its renormalisation, and expert groups it can score."""
    want = MOE[arch].norm
    if want is not None and facts["norm"] != want:
        raise NotGGUFExportable(f"norm_topk_prob={facts['norm']}: llama.cpp's {arch} "
                                f"{'renormalises' if want else 'does not renormalise'} the top-k weights")
    if facts["scale"] != 1.0 and arch != "deepseek2":
        raise NotGGUFExportable(f"routed_scaling_factor={facts['scale']}: llama.cpp's {arch} does not scale the "
                                "routed weights")
    if grouped(facts) and experts is not None and experts // facts["n_group"] < 2:
        raise NotGGUFExportable(f"{facts['n_group']} expert groups of {experts // facts['n_group']} expert: "
                                "llama.cpp scores a group by its two best experts")


def grouped(facts: dict) -> bool:
    """Whether the group limit selects anything (all groups kept is plain top-k; llama.cpp asserts fewer kept)."""
    return 1 < facts["n_group"] and facts["topk_group"] < facts["n_group"]


def check_layers(blocks: list, config, arch: str) -> None:
    """The MoE layers (``moe_blocks``) are ones llama.cpp's ``arch`` runs (``check_moe``), where it has them: every
    layer, or (deepseek2) every layer after the ``first_k_dense_replace`` leading dense ones."""
    for i, block in blocks:
        check_moe(block, f"layer {i}", arch)  # the router's kind before its settings (check_routing)
    ids = [i for i, _ in blocks]
    first = config.first_k_dense_replace if arch == "deepseek2" else 0
    want = list(range(first, config.num_hidden_layers))
    if ids and ids != want:
        dense = sorted(set(range(config.num_hidden_layers)) - set(ids))
        raise NotGGUFExportable(f"MoE layers {ids}, dense layers {dense}: llama.cpp's {arch} has MoE layers {want}")


def write_metadata(writer, config, arch: str, experts: int | None, expert_ffn: int | None,
                   used: int | None = None, moe: dict | None = None) -> None:
    """The architecture's hyperparameters, named as llama.cpp reads them. ``moe``: ``routing_facts`` plus the
    shared experts' width (``shared_ffn``) where the layers have them."""
    writer.add_name(os.path.basename(str(getattr(config, "name_or_path", "") or "moe-zoo model")) or "moe-zoo model")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    if arch == "deepseek2":
        write_mla(writer, config)
    else:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
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
        # olmoe sizes its experts by feed_forward_length, the others by expert_feed_forward_length
        dense_ffn = expert_ffn if arch == "olmoe" else getattr(config, "intermediate_size", expert_ffn)
        writer.add_feed_forward_length(dense_ffn)
        writer.add_expert_feed_forward_length(expert_ffn)
        write_moe_extras(writer, config, arch, expert_ffn, moe or {})
    else:
        writer.add_feed_forward_length(config.intermediate_size)


def write_mla(writer, config) -> None:
    """DeepSeek's multi-head latent attention as llama.cpp's absorbed form reads it: one cached key/value "head" of
    the latent (kv_lora_rank) plus the rotary part; the per-head sizes after decompression under the _mla keys."""
    rank, rot = config.kv_lora_rank, config.qk_rope_head_dim
    writer.add_head_count_kv(1)
    writer.add_key_length(rank + rot)
    writer.add_value_length(rank)
    writer.add_key_length_mla(config.qk_nope_head_dim + rot)
    writer.add_value_length_mla(config.v_head_dim)
    writer.add_rope_dimension_count(rot)
    writer.add_q_lora_rank(config.q_lora_rank or 0)  # 0: the plain query projection (llama.cpp's "lite" path)
    writer.add_kv_lora_rank(rank)
    writer.add_vocab_size(config.vocab_size)


def write_moe_extras(writer, config, arch: str, expert_ffn: int, moe: dict) -> None:
    """Shared experts, leading dense layers and DeepSeek's gating, where the architecture has them."""
    import gguf

    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(moe["shared_ffn"])
    if arch != "deepseek2":
        return
    shared, rest = divmod(moe["shared_ffn"], expert_ffn)
    if rest:
        raise NotGGUFExportable(f"shared experts {moe['shared_ffn']} wide are no whole number of {expert_ffn}-wide "
                                "experts: llama.cpp's deepseek2 sizes them expert_shared_count x the experts' width")
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_expert_shared_count(shared)
    writer.add_expert_weights_scale(moe["scale"])
    writer.add_expert_weights_norm(moe["norm"])
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if grouped(moe):
        writer.add_expert_group_count(moe["n_group"])
        writer.add_expert_group_used_count(moe["topk_group"])


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
    else:
        config = source.config
        origin = getattr(config, "name_or_path", "")
        folder = Path(origin) if origin and os.path.isdir(origin) else None
    arch = check_config(config)
    blocks = moe_blocks(source, config)
    check_layers(blocks, config, arch)
    facts = routing_facts(blocks, config)
    check_routing(facts, arch)
    tensors = folder_tensors(folder) if isinstance(source, (str, os.PathLike)) else model_tensors(source, arch)
    tokenizer = read_tokenizer(folder, config.vocab_size)  # refused before any tensor is written
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    tied = getattr(config, "tie_word_embeddings", False)
    report, shapes = Report(os.fspath(path)), Shapes()
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
                shapes.note(gname, array)
                if gname == "token_embd.weight" and tied and arch in OUTPUT_REQUIRED:
                    writer.add_tensor("output.weight", array, raw_dtype=kind)  # ...except these loaders
        count, expert_ffn, shared_ffn = shapes.moe(facts["top_k"])
        check_routing(facts, arch, count)
        write_metadata(writer, config, arch, count, expert_ffn or getattr(config, "moe_intermediate_size", None)
                       or getattr(config, "intermediate_size", None), facts["top_k"],
                       {**facts, "shared_ffn": shared_ffn})
        write_tokenizer(writer, tokenizer)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if "BF16" in report.types else gguf.LlamaFileType.ALL_F32)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=False)
        writer.close()
    return report


@dataclass
class Shapes:
    """What the written tensors say of the MoE layers: expert counts (after pruning, fewer than the config says),
    the experts' and the shared experts' widths; GGUF holds one of each for all layers."""
    experts: set = field(default_factory=set)
    widths: set = field(default_factory=set)
    shared: set = field(default_factory=set)

    def note(self, gname: str, array) -> None:
        if gname.endswith("ffn_gate_inp.weight"):
            self.experts.add(array.shape[0])
        elif gname.endswith("ffn_gate_exps.weight"):
            self.widths.add(array.shape[1])  # [E, I, H] (or H's block bytes)
        elif gname.endswith("ffn_gate_shexp.weight"):
            self.shared.add(array.shape[0])

    def moe(self, used: int | None) -> tuple[int | None, int | None, int | None]:
        for label, values in (("numbers of experts", self.experts), ("expert widths", self.widths),
                              ("shared expert widths", self.shared)):
            if len(values) > 1:
                raise NotGGUFExportable(f"layers hold different {label} {sorted(values)}: GGUF has one for all "
                                        "layers")
        count = next(iter(self.experts), None)
        if count is not None and used is not None and used > count:
            raise NotGGUFExportable(f"the router picks {used} experts per token but layers hold {count}: llama.cpp "
                                    f"would read past them (set num_experts_per_tok <= {count})")
        return count, next(iter(self.widths), None), next(iter(self.shared), None)


ZOO_NAMES = ((".router.", ".gate."), (".shared_experts.gate.weight", ".shared_expert_gate.weight"))
MLA_ROPE_ROWS = ("self_attn.q_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight")


def native_name(name: str) -> str:
    """A zoo folder's name of a router or shared-expert gate as the family's checkpoints (and gguf's map) name it."""
    if ".mlp." in name:
        for zoo_part, native in ZOO_NAMES:
            name = name.replace(zoo_part, native)
    return name


def gguf_tensors(name: str, value, names, arch: str, config):
    """(GGUF name, array, GGUF type, change, scale) for one native tensor (two for a fused gate/up stack or
    DeepSeek's kv_b_proj)."""
    import gguf

    T = gguf.GGMLQuantizationType
    name = native_name(name)
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
    if name.endswith("e_score_correction_bias"):  # DeepSeek's selection bias
        yield tensor_name("FFN_EXP_PROBS_B", layer, "bias"), *float_array(value, keep=False), None, 1.0
        return
    if name.endswith("shared_expert_gate.weight"):  # Qwen2-MoE's [1, H] gate: llama.cpp's is one vector [H]
        yield tensor_name("FFN_GATE_INP_SHEXP", layer), *float_array(value.reshape(-1), keep=False), None, 1.0
        return
    if arch == "deepseek2" and name.endswith("self_attn.kv_b_proj.weight"):
        if not isinstance(value, torch.Tensor):
            raise NotGGUFExportable(f"{name} is quantized: llama.cpp's deepseek2 stores it transposed per head "
                                    "(attn_k_b), which GGUF's blocks cannot be; quantize without the attention")
        for part, w in zip(("ATTN_K_B", "ATTN_V_B"), mla_kv_b(value, config)):
            yield tensor_name(part, layer), *float_array(w), None, 1.0
        return
    if not isinstance(value, torch.Tensor) and hasattr(value, "packed"):  # a quantized linear layer
        gname = names.get_name(name, try_suffixes=(".weight",))
        if gname is None:
            raise NotGGUFExportable(f"{name}: no GGUF tensor for it in llama.cpp's {arch} architecture")
        kind, codes, s, low, ref = linear_codes(value)
        codes, s, ref = (rope_rows(t, name, arch, config) for t in (codes, s, ref))
        low = None if low is None else rope_rows(low, name, arch, config)
        data, got = quantized_blocks(kind, codes, s, low)
        yield gname, data, T[kind], got - ref, float(ref.abs().max())
        yield from zero_qkv_bias(gname, ref.shape[0], arch, config)
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
    value = rope_rows(value, name, arch, config)
    small = value.dim() == 1 or gname.endswith("ffn_gate_inp.weight")  # norms and routers: F32, as llama.cpp keeps them
    array, kind = float_array(value, keep=not small)
    yield gname, array, kind, None, 1.0
    yield from zero_qkv_bias(gname, value.shape[0], arch, config)


def zero_qkv_bias(gname: str, rows: int, arch: str, config):
    """llama.cpp's qwen2moe loader requires query/key/value biases: zeros (adding nothing) for a model without."""
    import gguf

    if arch == "qwen2moe" and not getattr(config, "qkv_bias", True) \
            and gname.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight")):
        yield gname.removesuffix("weight") + "bias", np.zeros(rows, np.float32), gguf.GGMLQuantizationType.F32, \
            None, 1.0


def rope_rows(w: torch.Tensor, name: str, arch: str, config) -> torch.Tensor:
    """Query/key rows (weights, codes or scales: rows first) in the order llama.cpp's rotation of ``arch`` pairs
    them: the ``llama`` architecture's pairs always, DeepSeek's rotary part where the checkpoint rotates halves."""
    if arch in PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
        return permute_rope(w, config.num_attention_heads if "q_proj" in name else config.num_key_value_heads)
    if arch == "deepseek2" and not getattr(config, "rope_interleave", True) and name.endswith(MLA_ROPE_ROWS):
        heads = 1 if "kv_a_proj" in name else config.num_attention_heads  # kv_a: [latent, rotary key] rows
        return permute_rope_part(w, heads, config.qk_rope_head_dim)
    return w


def permute_rope_part(w: torch.Tensor, heads: int, rot: int) -> torch.Tensor:
    """``permute_rope`` on the last ``rot`` rows of each of ``heads`` row blocks (DeepSeek: [no rope | rope])."""
    rows = w.shape[0] // heads
    blocks = w.reshape(heads, rows, *w.shape[1:])
    tail = permute_rope(blocks[:, rows - rot:].reshape(heads * rot, *w.shape[1:]), heads)
    return torch.cat([blocks[:, :rows - rot], tail.reshape(heads, rot, *w.shape[1:])], 1).reshape(w.shape)


def mla_kv_b(w: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's ``kv_b_proj`` [H * (nope + v), latent] (each head's key rows, then its value rows) as llama.cpp's
    absorbed MLA reads it: ``attn_k_b`` [H, latent, nope] (transposed: it multiplies the query) and ``attn_v_b``
    [H, v, latent]."""
    nope = config.qk_nope_head_dim
    kv = w.reshape(config.num_attention_heads, nope + config.v_head_dim, w.shape[-1])
    return kv[:, :nope].transpose(1, 2).contiguous(), kv[:, nope:].contiguous()


def tensor_name(part: str, layer: str, kind: str = "weight") -> str:
    import gguf

    return gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[part]].format(bid=layer) + "." + kind
