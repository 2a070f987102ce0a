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
  * Granite-MoE (and Granite-MoE-Shared) -> ``granitemoe``: softmax top-k renormalised, pairwise rotation (rows
    reordered as for ``llama``), the multipliers under ``embedding_scale``, ``residual_scale``, ``attention.scale``
    and ``logit_scale`` (the logits' divisor); the decoder layer's shared MLP (one [gate; up] projection, split) as
    ``ffn_*_shexp`` with ``expert_shared_feed_forward_length``; experts sized by ``feed_forward_length``.
  * ERNIE-4.5-MoE -> ``ernie4_5-moe``: softmax scores, the selection bias (``exp_probs_b``) on them, renormalised; the
    plain shared expert where there is one; its leading dense layers (``moe_layer_start_index``), every later layer
    MoE (``interleave_moe_layer_step`` 1: llama.cpp loads no dense layer after the first MoE one).
  * Hunyuan-MoE (HunYuanMoEV1) -> ``hunyuan-moe``: softmax top-k renormalised plus the shared MLP; per-head
    query/key norms after the rotation; experts sized by ``feed_forward_length``.
  * dots.llm1 -> ``dots1`` and GLM-4.5 (Glm4Moe) -> ``glm4moe``: the gating the file states (``expert_gating_func``,
    sigmoid here, the selection bias, groups, ``expert_weights_norm``/``scale``), shared experts
    (``expert_shared_count``), leading dense layers, per-head query/key norms before the rotation; glm4moe also
    rotates part of each head (``partial_rotary_factor``: ``rope.dimension_count``) and has q/k/v biases.
  * DeepSeek-V2 -> ``deepseek2`` with softmax gating (no selection bias), not renormalised, scaled; its group-limited
    routing scores a group by its best expert where llama.cpp sums the two best: refused where the group limit
    changes the choice. Its rotary embedding is interleaved already.
  * these families convert through the zoo's generic adapter: the zoo model (or a zoo folder) exports; a native one
    is sent to ``zoo.convert`` first.
  * PhiMoE is refused: llama.cpp's ``phimoe`` runs RMSNorm (plus bias) and softmax top-k routing, PhiMoE LayerNorm and
    sparsemixer routing.
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
  * layers of different expert counts (per-layer pruning) are padded to the largest count with experts the router
    never picks, where llama.cpp's graph makes that exact (``padding_plan``): sigmoid scores with the selection bias
    (deepseek2, dots1, glm4moe), a padded expert getting a zero router row, zero weights and the lowest f32 as its
    selection bias (written where the layer has none), so top-k never reaches it and its score enters nothing; with
    expert groups each group is padded equally (its experts' groups unchanged, a group's two best still its own).
    Refused with the reason: architectures without a selection bias (a padded expert's logit would be 0, which
    top-k can pick), softmax scores (a padded expert still takes its share of every token's softmax), groups that
    padding cannot keep. ``Report.padding`` says how many experts were added and the bytes they cost.
  * otherwise uniform layouts only: every expert of a layer the same width, one routing (and one k) for all
    layers, routers llama.cpp computes; anything else is refused with ``NotGGUFExportable`` naming the part, before
    a file appears.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

ARCHS = {"mixtral": "llama", "mistral": "llama", "llama": "llama", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe",
         "olmoe": "olmoe", "deepseek_v3": "deepseek2", "granitemoe": "granitemoe", "granitemoeshared": "granitemoe",
         "ernie4_5_moe": "ernie4_5-moe", "hunyuan_v1_moe": "hunyuan-moe", "dots1": "dots1", "glm4_moe": "glm4moe",
         "deepseek_v2": "deepseek2"}
# families the zoo converts with its generic adapter: exported from the converted model (or a zoo folder) only
GENERIC = ("granitemoe", "granitemoeshared", "ernie4_5_moe", "hunyuan_v1_moe", "dots1", "glm4_moe", "deepseek_v2")
PARTIAL_ROPE = ("glm4moe",)  # architectures that rotate only part of each head (rope.dimension_count)
# native folders read tensor by tensor (transformers' fused expert stacks); other families' folders are loaded
STREAMED = ("mixtral", "mistral", "llama", "qwen3_moe")
PERMUTED = ("llama", "granitemoe")  # architectures whose rotary embedding interleaves pairs (q/k rows reordered)
# loaders without a tied-embedding fallback: output.weight
OUTPUT_REQUIRED = ("qwen2moe", "olmoe", "deepseek2", "dots1")
FFN_SIZES_EXPERTS = ("olmoe", "granitemoe", "hunyuan-moe")  # loaders that size the experts by feed_forward_length
# Granite's multipliers (config attribute) and the GGUF keys llama.cpp's granitemoe reads them from
GRANITE_SCALES = (("embedding_multiplier", "embedding_scale"), ("residual_multiplier", "residual_scale"),
                  ("attention_multiplier", "attention_scale"), ("logits_scaling", "logit_scale"))
QK = 32  # GGUF's block length for Q8_0 and Q4_1


@dataclass(frozen=True)
class MoESpec:
    """What llama.cpp's MoE layer of one architecture computes: its gating (``label`` names it): the score functions
    it can run (more than one: the file's ``expert_gating_func`` says which), whether the kept weights are
    renormalised (None: the file says, ``expert_weights_norm``), the shared expert it adds (None, "gated":
    Qwen2-MoE's, scaled by a sigmoid gate, "plain": DeepSeek's), whether it adds a selection bias (``exp_probs_b``;
    None: where the layer has one), scales the kept weights (``expert_weights_scale``) and limits the choice to
    expert groups (scored by their two best experts)."""
    label: str
    scores: tuple = ("softmax",)
    norm: bool | None = True
    shared: str | None = None
    selection_bias: bool | None = False
    scaled: bool = False
    groups: bool = False


SOFTMAX = "softmax top-k routing"
MOE = {"llama": MoESpec(SOFTMAX), "qwen3moe": MoESpec(SOFTMAX),
       "qwen2moe": MoESpec(SOFTMAX, norm=False, shared="gated"), "olmoe": MoESpec(SOFTMAX, norm=False),
       "deepseek2": MoESpec("DeepSeek's sigmoid routing with a selection bias", ("sigmoid",), None, "plain", True,
                            True, True),
       "granitemoe": MoESpec(SOFTMAX),
       "ernie4_5-moe": MoESpec("softmax top-k routing (a selection bias where the layer has one)", shared="optional",
                               selection_bias=None),
       "hunyuan-moe": MoESpec(SOFTMAX, shared="plain"),
       "dots1": MoESpec("softmax or sigmoid top-k routing (a selection bias where the layer has one)",
                        ("sigmoid", "softmax"), None, "plain", None, True, True),
       "glm4moe": MoESpec("sigmoid or softmax top-k routing with a selection bias", ("sigmoid", "softmax"), None,
                          "plain", True, True, True)}
# families whose layers run another of their architecture's gatings than MOE's (deepseek2 reads it from the file)
MOE_OF_FAMILY = {"deepseek_v2": MoESpec("DeepSeek-V2's softmax top-k routing", ("softmax",), None, "plain", False, True,
                                        True)}
# architectures that read their gating from the file (expert_gating_func, expert_weights_norm/scale, groups, ...)
GATED = ("deepseek2", "dots1", "glm4moe")


class NotGGUFExportable(ValueError):
    """The model has a layout llama.cpp does not run (the message says which part)."""


@dataclass
class Report:
    """What the export did: per GGUF type the tensors written, and the largest change the fp16 rounding of
    the quantized experts' scales made to a weight (absolute, and relative to that tensor's largest weight); where
    layers were padded to one expert count, ``padding`` in ``zoo.architectures.native.export_padding``'s form: ``{"num_experts":
    n, "layers": {layer: experts added}, "bytes": bytes the padding added to the file}`` (the padded experts' zero
    weights in their layer's GGUF types, their router rows and selection biases), else None."""
    path: str
    types: dict = field(default_factory=dict)
    max_abs_change: float = 0.0
    max_rel_change: float = 0.0
    padding: dict | None = None

    @property
    def padded_experts(self) -> int:
        """Experts added by the padding, over all layers (0: none)."""
        return sum(self.padding["layers"].values()) if self.padding else 0

    @property
    def padded_bytes(self) -> int:
        """Bytes the padding added to the file (0: none)."""
        return self.padding["bytes"] if self.padding else 0

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
    from zoo.moe import kernels
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

def model_tensors(model, arch: str = "llama", spec: MoESpec | None = None):
    """(native name, tensor or quantized module) of an in-memory zoo or native model, layer by layer. A quantized
    expert stack comes as ``("...experts", QuantizedExperts)`` under the layer's ``mlp.experts`` name, a quantized
    linear layer as ``("....weight", QuantizedLinear)``. Each MoE block is checked against llama.cpp's ``arch``
    layer before its tensors come."""
    from zoo.moe.layout import block_prefix, moe_layers
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
        check_moe(block, prefix, arch, spec)
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


def routing_rule(router) -> dict | None:
    """The rule a zoo router computes, in scored-topk's terms (score function, renormalisation, scale, selection bias,
    expert groups and how they are scored, logit soft-cap, what the selection bias is added to); None for a router
    whose rule is none of these (top-p, sparsemixer, ...)."""
    name = getattr(router, "name", "")
    rule = {"score": "softmax", "norm": bool(getattr(router, "norm_topk_prob", True)), "scale": 1.0,
            "selection_bias": False, "n_group": 1, "topk_group": 1, "group_score": "top2", "softcap": 0.0,
            "bias_on": "scores"}
    if name == "topk-softmax":
        return rule
    if name not in ("sigmoid-bias", "scored-topk"):
        return None
    rule.update(score="sigmoid", scale=float(router.routed_scaling_factor), selection_bias=True,
                n_group=int(router.n_group), topk_group=int(router.topk_group))
    if name == "scored-topk":
        rule.update(score=router.score, selection_bias=router.e_score_correction_bias is not None,
                    group_score=router.group_score, softcap=float(router.logit_softcap), bias_on=router.bias_on)
    return rule


def check_moe(block, where: str, arch: str = "llama", spec: MoESpec | None = None) -> None:
    """The layer computes what llama.cpp's ``arch`` MoE layer computes: its gating (renormalisation and expert groups
    are checked once for all layers, ``check_routing``), its shared expert and plain (or uniformly quantized) SwiGLU
    experts."""
    from zoo.moe.experts import SwiGLUExperts
    from zoo.moe.quantized import QuantizedExperts

    spec = spec or MOE[arch]
    parts = sorted(name for name, part in getattr(block, "parts", dict)().items() if part is not None)
    if parts:
        raise NotGGUFExportable(f"{where}: llama.cpp's {arch} MoE layer has no place for the block's {', '.join(parts)}")
    router = type(block.router).__name__
    rule = routing_rule(block.router)
    if rule is None or rule["score"] not in spec.scores or getattr(block.router, "bias", None) is not None \
            or (spec.selection_bias is not None and rule["selection_bias"] != spec.selection_bias):
        raise NotGGUFExportable(f"{where}: llama.cpp's {arch} layers run {spec.label}; this layer's router "
                                f"is {router} ({getattr(block.router, 'name', '?')}"
                                f"{', ' + str(block.router.options) if rule else ''})")
    if getattr(block.router, "serving_map", None) is not None:
        raise NotGGUFExportable(f"{where}: the router maps several rows to one expert (hc-smoe's expert map); "
                                "export it natively (zoo.export expands the map), then to GGUF from that folder")
    check_shared(getattr(block, "shared_experts", None), where, arch, spec)
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


def check_shared(shared, where: str, arch: str, spec: MoESpec | None = None) -> None:
    """The shared expert is the one llama.cpp's ``arch`` layer adds: a SiLU SwiGLU MLP, sigmoid-gated for qwen2moe."""
    from zoo.moe.block import SharedMLP

    want = (spec or MOE[arch]).shared
    if want == "optional":  # the file says whether there is one (expert_shared_feed_forward_length)
        if shared is None:
            return
        want = "plain"
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
    the zoo's one reader (``zoo.io.checkpoint.read_checked``: dtype, shape and bounds against the header, finite). Experts
    stored apart are stacked per layer as transformers stacks them (``experts.gate_up_proj [E, 2I, H]``,
    ``experts.down_proj [E, H, I]``), one layer's experts held at a time."""
    from zoo.io.checkpoint import checked_weight_map, read_checked

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
    a symbolic link (an export never replaces a file: ``zoo.io.atomic.check_new_file``)."""
    from zoo.io.atomic import check_new_file

    return check_new_file(path)


def native_folder(source: str) -> str | None:
    """The local folder of ``source`` (a folder, registry name or hub id) when it holds a native checkpoint of a
    family whose folders GGUF export streams (``STREAMED``) with its experts stored stacked, which is then read
    tensor by tensor; None when the model must be loaded."""
    from transformers import AutoConfig

    from zoo.io.loading import resolve_path

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
    if family in REFUSED:
        raise NotGGUFExportable(REFUSED[family])
    if arch is None:
        raise NotGGUFExportable(f"GGUF export covers {', '.join(sorted(ARCHS))} models, got {config.model_type}")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise NotGGUFExportable(f"rope_type {rope.get('rope_type')!r}: only the default rotary embedding is mapped")
    if rotary_fraction(config) != 1.0 and arch not in PARTIAL_ROPE:
        raise NotGGUFExportable(f"partial_rotary_factor={rotary_fraction(config)}: llama.cpp's {arch} rotates whole "
                                "heads")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise NotGGUFExportable(f"hidden_act {config.hidden_act!r}: llama.cpp's layers here are SwiGLU")
    if family in GENERIC and not config.model_type.startswith("zoo_"):
        raise NotGGUFExportable(f"a native {family} model: GGUF export reads the zoo's conversion of it (zoo.convert "
                                "the model, or zoo.load the folder, then export that)")
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
    if getattr(config, "mlp_bias", False):
        return "mlp_bias: llama.cpp's deepseek2 MLPs have no biases"
    lite = config.num_hidden_layers in (26, 27) or (config.num_hidden_layers, config.vocab_size) == (48, 128256)
    if config.q_lora_rank and lite:  # llama.cpp then never reads q_lora_rank
        return (f"q_lora_rank={config.q_lora_rank} with {config.num_hidden_layers} layers: llama.cpp reads such a "
                "deepseek2 as a \"lite\" model (DeepSeek-V2-Lite), without a query LoRA")
    return None


REFUSED = {  # families whose llama.cpp architecture computes something else
    "phimoe": "PhiMoE has no exact GGUF form: llama.cpp's phimoe normalises with RMSNorm (plus a bias) where PhiMoE "
              "has LayerNorms (which subtract the mean), and routes by softmax top-k renormalised where PhiMoE runs "
              "sparsemixer (each pick weighted by a softmax over the logits close to it)",
}


def _gpt_oss_problem(config) -> str:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type") == "yarn" and not rope.get("truncate", True):
        return ("GPT-OSS has no exact GGUF form: llama.cpp's gpt-oss rounds YaRN's correction range to whole "
                "dimensions (ggml_rope_yarn_corr_dims) where this model leaves it unrounded (truncate=False), so "
                "llama.cpp would rotate queries and keys at other frequencies")
    return ("GGUF export does not map GPT-OSS (attention sinks, sliding window, biased clamped-SwiGLU experts) to "
            "llama.cpp's gpt-oss yet")


def _granite_problem(config) -> str | None:
    for name, key in GRANITE_SCALES:
        if not getattr(config, name, 1.0):
            return (f"{name}=0: llama.cpp's granitemoe reads a {key} of 0 as no scaling at all (the model multiplies "
                    "by 0)")
    return None


def _hunyuan_problem(config) -> str | None:
    if getattr(config, "attention_bias", False):
        return "attention_bias: llama.cpp's hunyuan-moe has no bias on the attention output"
    return None


def _dots1_problem(config) -> str | None:
    if config.num_key_value_heads != config.num_attention_heads:
        return (f"{config.num_key_value_heads} key/value heads for {config.num_attention_heads} query heads: "
                "llama.cpp's dots1 loader sizes the key and value projections for as many heads as queries")
    if getattr(config, "attention_bias", False):
        return "attention_bias: llama.cpp's dots1 has no bias on the attention output"
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        return "sliding-window layers: llama.cpp's dots1 attends over the whole context in every layer"
    return None


def _glm4_moe_problem(config) -> str | None:
    if not config.n_shared_experts:
        return "no shared expert: llama.cpp's glm4moe runs one in every MoE layer"
    return None


def _ernie_problem(config) -> str | None:
    if getattr(config, "use_bias", False):
        return ("use_bias: llama.cpp's ernie4_5-moe leaves out the attention output's bias (and has none for the "
                "MLPs and the LM head)")
    last = config.num_hidden_layers - 1
    if config.moe_layer_interval != 1 or config.moe_layer_end_index not in (-1, last):
        return (f"MoE layers every {config.moe_layer_interval} from {config.moe_layer_start_index} to "
                f"{config.moe_layer_end_index}: llama.cpp's ernie4_5-moe loads MoE layers from the first MoE layer to "
                "the last one (its interleave step runs the dense ones with tensors it never loads)")
    return None


FAMILY_CHECKS = {"qwen2_moe": _qwen_problem, "qwen3_moe": _qwen_problem, "olmoe": _olmoe_problem,
                 "deepseek_v3": _deepseek_problem, "deepseek_v2": _deepseek_problem, "granitemoe": _granite_problem,
                 "granitemoeshared": _granite_problem, "ernie4_5_moe": _ernie_problem,
                 "hunyuan_v1_moe": _hunyuan_problem, "dots1": _dots1_problem,
                 "glm4_moe": _glm4_moe_problem}


def moe_blocks(source, config) -> list:
    """(layer, SparseMoE) of the MoE layers: a model's own, or for a zoo folder its ``zoo_layout`` built on the meta
    device (the same checks then read the same modules); [] for a native checkpoint (its family's own blocks)."""
    from zoo.moe.layout import build_block, moe_layers

    if isinstance(source, torch.nn.Module):
        return moe_layers(source)
    with torch.device("meta"):
        return [(i, build_block(entry)) for i, entry in enumerate(getattr(config, "zoo_layout", None) or [])
                if entry]


FACTS = ("top_k", "score", "norm", "scale", "selection_bias", "n_group", "topk_group", "group_score", "softcap",
         "bias_on")


def routing_facts(blocks: list, config, arch: str = "llama", spec: MoESpec | None = None) -> dict:
    """The routing of every MoE layer, which GGUF holds once for all: k, the score function, renormalisation, the
    routed weights' scale, the selection bias and expert groups; read off the routers (``moe_blocks``), else off the
    config (a native checkpoint: its family's routing, the one its architecture runs)."""
    rules = [{"top_k": int(block.router.top_k), **(routing_rule(block.router) or {})} for _, block in blocks]
    for rule in rules:
        if rule.get("n_group") is not None and not grouped(rule):
            rule.update(n_group=1, topk_group=1)  # groups that limit nothing: plain top-k, as llama.cpp runs it
    seen = {tuple(rule.get(k) for k in FACTS) for rule in rules}
    if not rules:
        spec = spec or MOE[arch]
        seen = {(getattr(config, "num_experts_per_tok", None), spec.scores[0],
                 bool(getattr(config, "norm_topk_prob", True)), float(getattr(config, "routed_scaling_factor", 1.0)),
                 bool(spec.selection_bias), int(getattr(config, "n_group", None) or 1),
                 int(getattr(config, "topk_group", None) or 1), "top2", 0.0, "scores")}
    ks = {k for k, *_ in seen}
    if len(ks) > 1:
        raise NotGGUFExportable(f"layers route to different numbers of experts {sorted(ks)}: GGUF has one "
                                "expert_used_count")
    if len(seen) > 1:
        apart = {tuple(v for k, v in zip(FACTS, s) if k not in ("n_group", "topk_group")) for s in seen}
        if len(apart) == 1:
            raise NotGGUFExportable(groups_problem(blocks, rules))
        raise NotGGUFExportable(f"layers route differently ({', '.join(FACTS)}: {sorted(seen, key=str)}): GGUF holds "
                                "one routing for all layers")
    return dict(zip(FACTS, seen.pop()))


def groups_problem(blocks: list, rules: list[dict]) -> str:
    """Why layers that route alike but for their expert groups have no GGUF form (``routing_facts``)."""
    def how(block, rule) -> str:
        n, kept = rule["n_group"], rule["topk_group"]
        count = int(block.num_experts)
        if n == 1:
            return f"{count} experts, picked among all"
        return f"{count} experts, picked among the best {kept} of {n} groups of {count // n}"

    kinds = {}
    for (i, block), rule in zip(blocks, rules):
        kinds.setdefault(how(block, rule), []).append(i)
    layers = "; ".join(f"layer{'s' * (len(ids) > 1)} {', '.join(map(str, ids))}: {label}"
                       for label, ids in kinds.items())
    return (f"layers differ in their expert groups ({layers}): llama.cpp applies one expert_group_count to every "
            "layer of a file, and padding a layer (experts the router never picks) cannot give it groups it does not "
            "route by nor take away the groups another routes by, so llama.cpp would choose other experts (the "
            "zoo's pruning turns off the groups of a layer it cuts; a layer that keeps its router's groups, each with "
            "as many experts, at least two, is padded exactly)")


def check_routing(facts: dict, arch: str, experts: int | None = None, spec: MoESpec | None = None) -> None:
    """llama.cpp's ``arch`` can hold that routing: its renormalisation, scale, and expert groups it can score."""
    spec = spec or MOE[arch]
    want = spec.norm
    if want is not None and facts["norm"] != want:
        raise NotGGUFExportable(f"norm_topk_prob={facts['norm']}: llama.cpp's {arch} "
                                f"{'renormalises' if want else 'does not renormalise'} the top-k weights")
    if facts["scale"] != 1.0 and not spec.scaled:
        raise NotGGUFExportable(f"routed_scaling_factor={facts['scale']}: llama.cpp's {arch} does not scale the "
                                "routed weights")
    if facts["softcap"]:
        raise NotGGUFExportable(f"router logits soft-capped at {facts['softcap']}: llama.cpp's {arch} does not cap "
                                "them")
    if facts["selection_bias"] and facts["bias_on"] != "scores":
        raise NotGGUFExportable(f"the selection bias is added to the router's logits: llama.cpp's {arch} adds it to "
                                "the scores")
    if grouped(facts):
        if not spec.groups:
            raise NotGGUFExportable(f"expert groups ({facts['topk_group']} of {facts['n_group']}): llama.cpp's {arch} "
                                    "picks among all experts")
        if facts["group_score"] != "top2":
            raise NotGGUFExportable(f"expert groups scored by their {facts['group_score']} expert: llama.cpp scores "
                                    "a group by the sum of its two best experts")
        if experts is not None and experts // facts["n_group"] < 2:
            raise NotGGUFExportable(f"{facts['n_group']} expert groups of {experts // facts['n_group']} expert: "
                                    "llama.cpp scores a group by its two best experts")


def grouped(facts: dict) -> bool:
    """Whether the group limit selects anything (all groups kept is plain top-k; llama.cpp asserts fewer kept)."""
    return 1 < facts["n_group"] and facts["topk_group"] < facts["n_group"]


# ------------------------------------------------------------------------------------- padding to one count

NEVER = float(np.finfo(np.float32).min)  # a padded expert's selection bias: score + NEVER is the lowest f32
# the GGUF tensors of a layer that hold one row per expert (padded along their first dimension)
EXPERT_ROWS = ("ffn_gate_inp.weight", "exp_probs_b.bias", "ffn_gate_exps.weight", "ffn_up_exps.weight",
              "ffn_down_exps.weight")
BLOCK_NAME = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<part>.+)$")


@dataclass(frozen=True)
class Padding:
    """How layers of fewer experts are padded to ``count``: ``slots[layer]``, the positions the layer's experts take
    among the ``count`` (the others are padded experts); ``add_bias``: the layers have no selection bias of their
    own, so a padded layer gets one (0 for its experts, ``NEVER`` for the padded ones)."""
    count: int
    slots: dict
    add_bias: bool

    def layers(self) -> dict:
        return {i: self.count - len(s) for i, s in sorted(self.slots.items())}


def padding_plan(blocks: list, facts: dict, arch: str) -> Padding | None:
    """How the MoE layers (``moe_blocks``, routed alike: ``routing_facts``) go to GGUF's one expert count: None when
    they hold one already, else the padding that leaves llama.cpp's ``arch`` computing what each layer computes, or
    NotGGUFExportable saying why there is none.

    llama.cpp's build_moe_ffn scores every expert of the file (``probs``), adds the selection bias ``exp_probs_b``
    for the choice only, keeps the best ``n_group_used`` groups of ``n_expert / n_expert_groups`` (a group scored by
    the sum of its two best), picks the top k and weights them by their own ``probs``. A padded expert has a zero
    router row, zero weights and the selection bias ``NEVER``: its score is the lowest f32, so top-k never reaches
    it while a layer has k experts of its own to pick. That is exact where the scores are sigmoids (each expert's
    own; a padded one's enters no other weight) and the architecture reads a selection bias; groups are kept by
    padding each group equally (the layer's experts keep their groups, a group's two best stay its own while it has
    two experts of its own)."""
    counts = {i: int(block.num_experts) for i, block in blocks}
    if len(set(counts.values())) <= 1:
        return None
    low, high = min(counts, key=counts.get), max(counts, key=counts.get)
    differ = (f"layer {low} has {counts[low]} experts and layer {high} {counts[high]}: GGUF holds one expert_count for "
              "every layer, so the smaller layers would be padded with experts the router never picks")
    if MOE[arch].selection_bias is False:
        raise NotGGUFExportable(f"{differ}; llama.cpp's {arch} routes by {MOE[arch].label} and its router has no bias "
                                "with which a padded expert could never be chosen (its zero router row gives it logit "
                                "0, which top-k can pick), so padding would not be exact")
    if facts["score"] != "sigmoid":
        undo = ("renormalising the kept weights undoes that only until their sum underflows or falls under llama.cpp's "
                "clamp" if facts["norm"] else "the kept weights are not renormalised, so every one would shrink")
        raise NotGGUFExportable(f"{differ}; llama.cpp's {arch} takes the {facts['score']} over all the file's experts, "
                                "and a padded expert, though a selection bias would keep it from being chosen, still "
                                "takes its share exp(0) of every token's softmax (its zero router row gives it logit "
                                f"0, and the router has no bias to lower it): {undo}, so padding would not be exact "
                                "(with sigmoid scores, each expert's own, it is)")
    groups = facts["n_group"] if grouped(facts) else 1
    for i, count in counts.items():
        own = count // groups
        if count % groups:
            raise NotGGUFExportable(f"{differ}; layer {i}'s {count} experts are no whole number of experts in each of "
                                    f"its {groups} groups")
        if groups > 1 and own < 2:
            raise NotGGUFExportable(f"{differ}; layer {i} keeps {own} expert in each of its {groups} groups: llama.cpp "
                                    "scores a group by its two best experts, and a padded expert would be one of them")
        if groups > 1 and facts["top_k"] > facts["topk_group"] * own:
            raise NotGGUFExportable(f"{differ}; layer {i} picks {facts['top_k']} experts from {facts['topk_group']} "
                                    f"groups of {own} of its own: llama.cpp would pick padded experts")
    width = max(counts.values()) // groups  # experts per group once padded
    slots = {}
    for i, count in counts.items():
        if count < width * groups:
            own = np.arange(count)
            slots[i] = own // (count // groups) * width + own % (count // groups)  # group g's experts lead its slots
    return Padding(width * groups, slots, not facts["selection_bias"])


def padded(items, plan: Padding | None, added: dict):
    """``gguf_tensors``' items with the per-expert tensors of a padded layer (``plan``) widened to ``plan.count``
    experts: zero bytes for the padded experts' weights and router rows (zero in every GGUF type: F32, F16, BF16,
    and Q8_0/Q4_1 blocks of scale 0), ``NEVER`` for their selection bias; the layer's selection bias written where it
    has none. ``added[layer]`` sums the bytes the padding adds."""
    import gguf

    for gname, array, kind, change, scale in items:
        m = BLOCK_NAME.match(gname)
        slots = plan.slots.get(int(m["layer"])) if plan is not None and m else None
        if slots is None or m["part"] not in EXPERT_ROWS:
            yield gname, array, kind, change, scale
            continue
        layer = int(m["layer"])
        if array.shape[0] != len(slots):
            raise NotGGUFExportable(f"{gname} holds {array.shape[0]} experts where its layer has {len(slots)}")
        out = np.full((plan.count, *array.shape[1:]), NEVER if m["part"] == "exp_probs_b.bias" else 0, array.dtype)
        out[slots] = array
        added[layer] = added.get(layer, 0) + out.nbytes - array.nbytes
        yield gname, out, kind, change, scale
        if m["part"] == "ffn_gate_inp.weight" and plan.add_bias:
            bias = np.full(plan.count, NEVER, np.float32)
            bias[slots] = 0.0  # the layer's own experts: chosen by their scores alone, as before
            added[layer] += bias.nbytes
            yield tensor_name("FFN_EXP_PROBS_B", str(layer), "bias"), bias, gguf.GGMLQuantizationType.F32, None, 1.0


def dense_lead(config, arch: str) -> int:
    """How many leading dense layers llama.cpp's ``arch`` runs before its MoE layers (``leading_dense_block_count``)."""
    if arch == "ernie4_5-moe":
        return int(config.moe_layer_start_index)
    if arch in ("deepseek2", "dots1", "glm4moe"):
        return int(config.first_k_dense_replace or 0)
    return 0


def check_layers(blocks: list, config, arch: str, spec: MoESpec | None = None) -> None:
    """The MoE layers (``moe_blocks``) are ones llama.cpp's ``arch`` runs (``check_moe``), where it has them: every
    layer, or every layer after the leading dense ones (``dense_lead``)."""
    for i, block in blocks:
        check_moe(block, f"layer {i}", arch, spec)  # the router's kind before its settings (check_routing)
    ids = [i for i, _ in blocks]
    first = dense_lead(config, arch)
    want = list(range(first, config.num_hidden_layers))
    if ids and ids != want:
        dense = sorted(set(range(config.num_hidden_layers)) - set(ids))
        raise NotGGUFExportable(f"MoE layers {ids}, dense layers {dense}: llama.cpp's {arch} has MoE layers {want}")


def gguf_arch(arch: str):
    """gguf's MODEL_ARCH member of llama.cpp's architecture name (``ernie4_5-moe`` is ``ERNIE4_5_MOE``)."""
    import gguf

    return next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)


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
        writer.add_rope_dimension_count(int(head_dim * rotary_fraction(config)))
    rope = getattr(config, "rope_parameters", None) or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch == "granitemoe":  # Granite's multipliers (logits are divided by logits_scaling, the others multiply)
        for name, key in GRANITE_SCALES:
            getattr(writer, f"add_{key}")(float(getattr(config, name)))
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(used or config.num_experts_per_tok)
        # olmoe and granitemoe size their experts by feed_forward_length, the others by expert_feed_forward_length
        dense_ffn = expert_ffn if arch in FFN_SIZES_EXPERTS else getattr(config, "intermediate_size", expert_ffn)
        writer.add_feed_forward_length(dense_ffn)
        writer.add_expert_feed_forward_length(expert_ffn)
        write_moe_extras(writer, config, arch, expert_ffn, moe or {})
    else:
        writer.add_feed_forward_length(config.intermediate_size)


def rotary_fraction(config) -> float:
    """The part of each head the rotary embedding turns (partial_rotary_factor; 1: all of it)."""
    rope = getattr(config, "rope_parameters", None) or {}
    return float(rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0))


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

    if arch in ("qwen2moe", "hunyuan-moe") or (arch in ("granitemoe", "ernie4_5-moe") and moe.get("shared_ffn")):
        writer.add_expert_shared_feed_forward_length(moe["shared_ffn"])
    if arch == "ernie4_5-moe":
        writer.add_leading_dense_block_count(dense_lead(config, arch))
        writer.add_interleave_moe_layer_step(1)
    if arch not in GATED:
        return
    shared, rest = divmod(moe["shared_ffn"], expert_ffn)
    if rest:
        raise NotGGUFExportable(f"shared experts {moe['shared_ffn']} wide are no whole number of {expert_ffn}-wide "
                                f"experts: llama.cpp's {arch} sizes them expert_shared_count x the experts' width")
    writer.add_leading_dense_block_count(dense_lead(config, arch))
    writer.add_expert_shared_count(shared)
    writer.add_expert_weights_scale(moe["scale"])
    writer.add_expert_weights_norm(moe["norm"])
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if moe["score"] == "sigmoid"
                                  else gguf.ExpertGatingFuncType.SOFTMAX)
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
    must not exist; the file appears complete or not at all (``zoo.io.atomic.atomic_file``: staged in a new hidden
    file beside it, never over a user's file or through a link)."""
    import gguf
    from tqdm.auto import tqdm
    from transformers import AutoConfig

    from zoo.io.atomic import atomic_file

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
    spec = MOE_OF_FAMILY.get(config.model_type.removeprefix("zoo_"), MOE[arch])
    check_layers(blocks, config, arch, spec)
    facts = routing_facts(blocks, config, arch, spec)
    check_routing(facts, arch, spec=spec)
    plan = padding_plan(blocks, facts, arch)
    tensors = folder_tensors(folder) if isinstance(source, (str, os.PathLike)) else model_tensors(source, arch, spec)
    tokenizer = read_tokenizer(folder, config.vocab_size)  # refused before any tensor is written
    names = gguf.get_tensor_name_map(gguf_arch(arch), config.num_hidden_layers)
    tied = getattr(config, "tie_word_embeddings", False)
    report, shapes, added = Report(os.fspath(path)), Shapes(), {}
    with atomic_file(path) as staged:
        writer = gguf.GGUFWriter(staged, arch, use_temp_file=True)
        for name, value in tqdm(tensors, desc="gguf", disable=not progress, unit=" tensors"):
            if name == "lm_head.weight" and tied:
                continue  # llama.cpp reads the output projection from token_embd when there is none
            for gname, array, kind, change, scale in padded(gguf_tensors(name, value, names, arch, config), plan,
                                                            added):
                if gname == "token_embd.weight" and array.shape[0] != config.vocab_size:
                    raise NotGGUFExportable(f"{name} has {array.shape[0]} rows but vocab_size is {config.vocab_size}")
                writer.add_tensor(gname, array, raw_dtype=kind)
                report.note(kind.name, change, scale)
                shapes.note(gname, array)
                if gname == "token_embd.weight" and tied and arch in OUTPUT_REQUIRED:
                    writer.add_tensor("output.weight", array, raw_dtype=kind)  # ...except these loaders
        count, expert_ffn, shared_ffn = shapes.moe(facts["top_k"])
        check_routing(facts, arch, count, spec)
        write_metadata(writer, config, arch, count, expert_ffn or getattr(config, "moe_intermediate_size", None)
                       or getattr(config, "intermediate_size", None), facts["top_k"],
                       {**facts, "shared_ffn": shared_ffn})
        write_tokenizer(writer, tokenizer)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if "BF16" in report.types else gguf.LlamaFileType.ALL_F32)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=False)
        writer.close()
    if plan is not None:
        report.padding = {"num_experts": plan.count, "layers": plan.layers(), "bytes": sum(added.values())}
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
    if ".mlp." in name or ".block_sparse_moe." in name:
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
    if name.endswith("shared_mlp.input_linear.weight"):  # Granite's shared MLP: [gate; up] in one projection
        parts = ("FFN_GATE_SHEXP", "FFN_UP_SHEXP")
        if isinstance(value, torch.Tensor):
            for part, w in zip(parts, value.chunk(2)):
                yield tensor_name(part, layer), *float_array(w), None, 1.0
            return
        kind, codes, s, low, ref = linear_codes(value)  # quantized: codes, scales and lows are per row too
        half = codes.shape[0] // 2
        for part, rows in zip(parts, (slice(0, half), slice(half, None))):
            data, got = quantized_blocks(kind, codes[rows], s[rows], None if low is None else low[rows])
            yield tensor_name(part, layer), data, T[kind], got - ref[rows], float(ref[rows].abs().max())
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
    if arch in PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
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
