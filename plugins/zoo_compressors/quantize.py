"""quantize: weight-only low-bit experts (packed 2/3/4/8-bit, torch's CPU int4/int8 kernels) with a bit
allocation: ``uniform``, ``pmq`` (MC#, needs calibration) or ``alphaq`` (AlphaQ, no calibration); formats:
``group_size="adaptive"`` (FineQuant: a group size per matrix by the error it causes) and ``dtype="bitmod"``
(BitMoD: each group picks the low-bit floating-point type that fits it best); ``symmetric=True`` stores the
2/3/4-bit integer groups as ``w = q s`` (no zero: what compressed-tensors' symmetric W4A16 holds exactly).
Gated experts (``swiglu``) become ``quantized`` experts, ungated ones (``mlp``: Nemotron-H, Switch Transformers)
``quantized-mlp`` experts, by the same scheme; BitMoD's lookup types exist for gated experts only."""
import numpy as np
import torch

from zoo import Compressor
from zoo.moe.experts import MLPExperts, SwiGLUExperts
from zoo.moe.quantized_linear import LINEAR_BITS, QuantizedLinear
from zoo.moe.quantized import (
    BITS,
    QuantizedExperts,
    QuantizedMLPExperts,
    dequantize,
    quantize_grouped,
    quantize_int8,
)
from zoo.moe.bitmod import BITMOD_BITS, DTYPES as LOOKUP_DTYPES
from zoo.moe.quantized_lookup import LookupQuantizedExperts
from zoo.components.options import suggest
from zoo.editing.stats import layer_stats
from zoo_compressors.allocation import WIDTHS, allocate, alphaq, esd_alpha, pmq
from zoo_compressors.finequant import adaptive_group, candidates
from zoo.components.controls import Control

ALLOCATIONS = ("uniform", "pmq", "alphaq", "random")  # random: the same budget spent blindly (a baseline)
TARGETS = ("experts", "all")  # all: the attention projections, dense MLPs and LM head too (as llama.cpp's q8_0/Q4_0)
GROUP_SIZES = (256, 128, 64, 32)  # what torch's int4 pack takes; the automatic choice prefers 64, then larger
ADAPTIVE = "adaptive"  # group_size: FineQuant's per-matrix choice
DTYPES = ("int",) + LOOKUP_DTYPES  # int: the asymmetric integer grid (int4 kernel); bitmod: BitMoD; fp: FP4/FP3 alone
DENSE = {SwiGLUExperts: QuantizedExperts, MLPExperts: QuantizedMLPExperts}  # dense kind -> its quantized kind
GROUP_ALPHA = 0.5  # FineQuant rule: a matrix keeps the coarsest group whose error is within 1.5x of the finest's


def auto_group_size(sizes) -> int | None:
    """The group size for layers whose input widths are ``sizes``: 64 when it divides them all (the default),
    else the largest of 128, 32 that does (256 is never picked: coarser groups lose accuracy); None if none."""
    for g in (64, 128, 32):
        if all(s % g == 0 for s in sizes):
            return g
    return None


def projections(experts) -> dict:
    """A dense experts module's weight stacks ``[E, N, K]`` under the names its quantized kind stores them by."""
    if isinstance(experts, MLPExperts):
        return {"up": experts.up_proj, "down": experts.down_proj}
    return {"gate_up": experts.gate_up_proj, "down": experts.down_proj}


def relative_error(w: torch.Tensor, bits: int, group_size: int, symmetric: bool = False) -> float:
    """||W - Q(W)||^2 / ||W||^2 for one weight at ``bits`` (``symmetric``: on the symmetric grid below 8 bits)."""
    if bits == 8:
        q, s = quantize_int8(w)
        deq = dequantize(8, q, s, w.shape, group_size)
    else:
        q, s, codes = quantize_grouped(w, group_size, bits, symmetric)
        deq = dequantize(bits, q, s, w.shape, group_size, codes=codes)
    return float((w.float() - deq).pow(2).sum() / w.float().pow(2).sum().clamp(min=1e-30))


class Quantize(Compressor):
    name = "quantize"
    summary = ("Packed 2/3/4/8-bit experts with real low-bit kernels; bits allocated uniformly, by PMQ (MC#) or "
               "AlphaQ; FineQuant's adaptive group sizes and BitMoD's per-group data types as formats.")
    paper = ("Huang et al., MC#: Mixture Compressor for Mixture-of-Experts Large Models, 2025, arXiv:2510.10962 "
             "(PMQ); AlphaQ: Calibration-Free Bit Allocation for MoE Quantization, 2026; Kim et al., FineQuant: "
             "Unlocking Efficiency with Fine-Grained Weight-Only Quantization for LLMs, 2023, arXiv:2308.09723 "
             "(group_size='adaptive'); Chen et al., BitMoD: Bit-serial Mixture-of-Datatype LLM Acceleration, HPCA "
             "2025, arXiv:2411.11745 (dtype='bitmod')")
    card = "cards/quantize.md"
    space = "compression-lab"
    experts_after = "quantized"  # what a later step of the same recipe is judged on

    @classmethod
    def demo_controls(cls, model=None):
        group, choices = cls.demo_group_sizes(model)
        return [Control("bits", "float", 8, low=WIDTHS[0], high=WIDTHS[-1], step=0.5,
                        help=f"bits per expert weight: one of {list(BITS)} (uniform), or an average (pmq, alphaq)"),
                Control("allocation", "choice", "uniform", choices=ALLOCATIONS,
                        help="uniform, or mixed precision per expert: pmq (usage), alphaq (weight spectra), random"),
                Control("group_size", "choice", group, choices=choices + (ADAPTIVE,),
                        help="weights per quantization scale below 8 bits (int8 is per output channel); adaptive: "
                             "FineQuant's choice per matrix"),
                Control("targets", "choice", "experts", choices=TARGETS,
                        help="experts only, or every matrix but the embeddings and routers (uniform 4 or 8 bits)"),
                Control("dtype", "choice", "int", choices=DTYPES,
                        help="int grid (kernels), or BitMoD's per-group FP types / plain FP (3 or 4 bits, uniform)")]

    @staticmethod
    def demo_group_sizes(model) -> tuple:
        """(default, choices): the group sizes of 32, 64, 128 that divide every layer's widths (64 if it does)."""
        from zoo.moe.layout import moe_layers

        sizes = {s for _, moe in (moe_layers(model) if model is not None else [])
                 for s in (getattr(moe.experts, "hidden_size", 0), getattr(moe.experts, "intermediate_size", 0))}
        choices = tuple(g for g in (32, 64, 128) if all(s % g == 0 for s in sizes)) or (64,)
        return (64 if 64 in choices else choices[0]), choices

    @classmethod
    def demo_presets(cls, model=None):
        group = {"group_size": cls.demo_group_sizes(model)[0]}
        return {"mild": {"bits": 8, **group}, "strong": {"bits": 3.5, "allocation": "pmq", **group}}

    def __init__(self, bits: float = 8, allocation: str = "uniform", group_size: int | str | None = None, widths=WIDTHS,
                 targets: str = "experts", dtype: str = "int", group_alpha: float | None = None,
                 symmetric: bool = False):
        """group_size: weights per scale below 8 bits; None picks one per layer, "adaptive" per matrix (FineQuant).
        dtype: "int" (the integer grid), "bitmod" (BitMoD's per-group FP types) or "fp" (one FP type, a baseline).
        group_alpha: with group_size="adaptive", how much more error than the finest group a coarser one may cost.
        symmetric: 2/3/4-bit integer groups as w = q s (codes -8..7 at 4 bits, no zero), compressed-tensors' W4A16.
        The default is w = (q - 8) s + z with a real-valued zero per group; int8 is symmetric anyway."""
        if not isinstance(symmetric, bool):
            raise ValueError(f"symmetric must be True or False, got {symmetric!r}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}{suggest(str(dtype), DTYPES)}")
        if isinstance(group_size, str) and group_size != ADAPTIVE:
            raise ValueError(f"group_size must be an integer, None or {ADAPTIVE!r}, got {group_size!r}"
                             f"{suggest(group_size, [ADAPTIVE])}")
        adaptive = group_size == ADAPTIVE
        if group_alpha is not None and not adaptive:
            raise ValueError("group_alpha tunes group_size='adaptive' (FineQuant); set that too, or drop group_alpha")
        if group_alpha is not None and (isinstance(group_alpha, bool) or not isinstance(group_alpha, (int, float))
                                        or not 0 <= group_alpha < float("inf")):
            raise ValueError(f"group_alpha must be a number >= 0, got {group_alpha!r}")
        if dtype != "int" and (allocation != "uniform" or bits not in BITMOD_BITS + (8,) or targets != "experts"
                               or adaptive):
            raise ValueError(f"dtype={dtype!r} quantizes the experts at one width: allocation='uniform', bits in "
                             f"{BITMOD_BITS} (8 stays int8), targets='experts' and a fixed group_size; got "
                             f"allocation={allocation!r}, bits={bits!r}, targets={targets!r}, "
                             f"group_size={group_size!r}")
        if allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {allocation!r}")
        if targets not in TARGETS:
            raise ValueError(f"targets must be one of {TARGETS}, got {targets!r}")
        if targets == "all" and (allocation != "uniform" or bits not in LINEAR_BITS):
            raise ValueError(f"targets='all' quantizes every matrix at one width: allocation='uniform' with bits in "
                             f"{LINEAR_BITS}, got allocation={allocation!r}, bits={bits!r}")
        if not isinstance(widths, (list, tuple)) or not widths or any(w not in BITS for w in widths):
            raise ValueError(f"widths must be a list of bit widths from {BITS}, got {widths!r}")
        widths = tuple(sorted({int(w) for w in widths}))
        if not isinstance(bits, (int, float)) or not widths[0] <= bits <= widths[-1]:
            raise ValueError(f"bits (average bits per expert weight) must be in [{widths[0]}, {widths[-1]}] "
                             f"(the widths {list(widths)}); got {bits!r}")
        if allocation == "uniform" and bits not in BITS:
            raise ValueError(f"uniform allocation needs bits in {BITS}; use pmq or alphaq for an average of {bits}")
        if group_size is not None and not adaptive and (not isinstance(group_size, int) or isinstance(group_size, bool)
                                                        or group_size < 32 or group_size % 32):
            raise ValueError(f"group_size must be a positive multiple of 32 (or None: chosen per layer, or "
                             f"{ADAPTIVE!r}: per matrix), got {group_size!r}")
        if symmetric and dtype != "int":
            raise ValueError(f"symmetric=True applies to dtype='int' (the integer grid); dtype={dtype!r} groups are "
                             "scaled symmetrically already")
        if symmetric and bits == 8:
            raise ValueError("symmetric=True changes nothing at bits=8: int8 is already symmetric (w = q s, one scale "
                             "per output row); use it below 8 bits")
        if symmetric and adaptive:
            raise ValueError("symmetric=True needs a fixed group_size (or None): group_size='adaptive' chooses groups "
                             "by the asymmetric grid's error")
        options = dict(bits=bits, allocation=allocation, group_size=group_size, widths=list(widths))
        defaults = {"targets": "experts", "dtype": "int", "group_alpha": None, "symmetric": False}
        extra = {k: v for k, v in (("targets", targets), ("dtype", dtype), ("group_alpha", group_alpha),
                                   ("symmetric", symmetric)) if v != defaults[k]}
        super().__init__(**options, **extra)  # the defaults stay out of the recipe (older recipes read the same)
        self.dtype, self.adaptive, self.symmetric = dtype, adaptive, symmetric
        self.group_alpha = GROUP_ALPHA if group_alpha is None else float(group_alpha)
        group_size = None if adaptive else group_size
        self.bits, self.allocation, self.group_size, self.widths = bits, allocation, group_size, widths
        self.targets, self.targets_linears = targets, targets == "all"
        self.needs_calibration = allocation == "pmq"
        self.needs_plan = allocation != "uniform"  # a bit budget over all experts of all layers
        self.inputs_for = ("observe",) if allocation == "pmq" else ()
        self.results: dict = {}
        self._experts: list[tuple[int, int]] = []  # (layer, expert), in the order observed
        self._sizes, self._errors, self._importance = [], [], []
        self._planned: dict[int, list[int]] = {}
        self._groups: dict[int, int] = {}  # layer -> the group size its sub-8-bit experts use

    def check_layer(self, index, block):
        if type(block.experts) not in DENSE:
            raise ValueError(f"layer {index} has {block.experts.name!r} experts; quantize needs dense experts "
                             "(swiglu or mlp)")
        if type(block.experts) is MLPExperts and block.experts.up_proj_bias is not None:
            raise ValueError(f"layer {index} has ungated 'mlp' experts with biases; quantize keeps no expert biases")
        if self.dtype != "int" and type(block.experts) is MLPExperts:
            raise ValueError(f"dtype={self.dtype!r} quantizes gated (swiglu) experts only; layer {index} has ungated "
                             "'mlp' experts: use dtype='int'")
        sizes = (block.experts.hidden_size, block.experts.intermediate_size)
        grouped = self.allocation != "uniform" or self.bits < 8  # int8 is per output channel: no groups
        if self.adaptive and grouped:
            bad = [s for s in sizes if not candidates(s)]
            if bad:
                raise ValueError(f"group_size='adaptive': no group size of {sorted(GROUP_SIZES)} divides layer "
                                 f"{index}'s size {bad[0]}")
        if self.group_size is not None:
            bad = [s for s in sizes if s % self.group_size]
            if grouped and bad:
                raise ValueError(f"group_size={self.group_size} does not divide layer {index}'s size {bad[0]} "
                                 f"(leave group_size unset to pick one that divides, or use bits=8)")
            self._groups[index] = self.group_size
        else:
            g = auto_group_size(sizes)
            if grouped and g is None:
                raise ValueError(f"no group size of {sorted(GROUP_SIZES)} divides layer {index}'s sizes {sizes}: "
                                 f"below 8 bits the int4 kernel needs one; bits=8 (per-channel) works")
            self._groups[index] = g or 64  # unused by all-int8 experts
        if self.group_size is not None or not grouped or self.adaptive:
            return
        if self._groups[index] != 64:
            self.results.setdefault("group_size_note", {})[str(index)] = (
                f"64 does not divide {sizes}; group size {self._groups[index]}")

    def linear_width(self, linear) -> tuple[int, int]:
        """(bits, group size) of one linear layer: 4-bit groups where a group size divides its input width and
        torch's int4 pack takes its output width (a multiple of 16); else 8 bits per output row, which fit any."""
        g = self.group_size if self.group_size is not None else auto_group_size((linear.in_features,))
        if self.adaptive and self.bits < 8 and candidates(linear.in_features) and linear.out_features % 16 == 0:
            w = linear.weight.detach()
            return int(self.bits), adaptive_group([(w, int(self.bits))], linear.in_features, self.group_alpha)[0]
        if self.bits == 8 or (g and linear.in_features % g == 0 and linear.out_features % 16 == 0):
            return int(self.bits), g or 64
        return 8, 64

    def compress_linear(self, name, linear):
        bits, group = self.linear_width(linear)
        summary = self.results.setdefault("linears", {"bits": int(self.bits), "count": 0, "weights": 0})
        summary["count"] += 1
        summary["weights"] += linear.weight.numel()
        if self.adaptive and bits < 8:
            summary.setdefault("group_size", {})[name] = group
        if bits != self.bits:
            summary.setdefault("at_8_bits", []).append(name)  # its shape has no 4-bit layout
        return QuantizedLinear.from_linear(linear, bits, group, symmetric=self.symmetric)

    @classmethod
    def build_module(cls, replaced, spec: dict) -> QuantizedLinear:
        """The empty quantized linear ``config.zoo_modules`` describes (``zoo.moe.layout.apply_modules`` calls this)."""
        return QuantizedLinear(**{k: v for k, v in spec.items() if k != "compressor"})

    def group_for(self, index) -> int:
        return self._groups.get(index, self.group_size or 64)

    def observe(self, index, block, inputs):
        """One layer's share of the global program: sizes, errors at each width and the importance input."""
        stacks = projections(block.experts)
        for e in range(block.num_experts):
            self._experts.append((index, e))
            self._sizes.append(sum(w[e].numel() for w in stacks.values()))  # 3HI gated, 2HI ungated
        if self.allocation == "random":
            return
        weights = [tuple(w[e].detach() for w in stacks.values()) for e in range(block.num_experts)]
        g = self.group_for(index)
        self._errors += [[sum(relative_error(w, b, g, self.symmetric) for w in pair) for b in self.widths]
                         for pair in weights]
        if self.allocation == "alphaq":
            self._importance += [float(np.mean([esd_alpha(w) for w in pair])) for pair in weights]
        else:  # MC#: significance from how often an expert is activated and how much weight it then gets
            st = layer_stats(index, block, inputs)
            self._importance += [float(st.frequency[e] * st.gate_sum[e] / max(1, st.counts[e]))
                                 for e in range(block.num_experts)]

    def plan(self):
        sizes = np.array(self._sizes, dtype=float)
        if self.allocation == "random":
            # the same program with blind inputs: random importance, and the textbook error 2^-2b for all
            rng = np.random.default_rng(0)
            blind = np.tile(2.0 ** (-2 * np.array(self.widths)), (len(sizes), 1))
            bits = allocate(rng.random(len(sizes)), blind, sizes, self.widths, self.bits)
        elif self.allocation == "alphaq":
            alphas = np.array(self._importance)
            self.results["alpha"] = [round(float(a), 3) for a in alphas]
            bits = alphaq(alphas, np.array(self._errors), sizes, self.widths, self.bits)
        else:
            bits = pmq(np.array(self._importance), np.array(self._errors), sizes, self.widths, self.bits)
        for (i, _), b in zip(self._experts, bits):
            self._planned.setdefault(i, []).append(int(b))

    def compress_layer(self, index, block, inputs):
        widths = [int(self.bits)] * block.num_experts if self.allocation == "uniform" else self._planned[index]
        group = self.group_for(index) if min(widths) < 8 else (self.group_size or 64)
        self.results.setdefault("bits", {})[str(index)] = list(map(int, widths))
        if self.dtype != "int" and widths[0] == 8:  # like a group size, a data type means nothing to int8 rows
            self.results["dtype_note"] = f"8 bits are int8 per output channel: dtype={self.dtype!r} applies below 8"
        elif self.dtype != "int":
            experts = LookupQuantizedExperts.from_dense(block.experts, int(self.bits), group, self.dtype)
            self.results.setdefault("group_size", {})[str(index)] = group
            if self.dtype == "bitmod":  # how many groups took each type (BitMoD's mixture at work)
                from zoo.moe.bitmod import TYPE_NAMES

                counts = sum(torch.bincount(experts.type_ids(p).flatten().long(), minlength=4)
                             for p in ("gate_up", "down"))
                self.results.setdefault("types", {})[str(index)] = dict(zip(TYPE_NAMES["bitmod"], counts.tolist()))
            return block.with_parts(experts=experts)
        groups = self.adaptive_groups(block.experts, widths) if self.adaptive and min(widths) < 8 else None
        if self.adaptive and groups is None:
            self.results["adaptive_note"] = "8 bits are int8 per output channel: no groups to choose"
        experts = DENSE[type(block.experts)].from_dense(block.experts, widths, group, group_sizes=groups,
                                                        symmetric=self.symmetric)
        if min(widths) < 8:
            self.results.setdefault("group_size", {})[str(index)] = groups or group
        return block.with_parts(experts=experts)

    def adaptive_groups(self, dense, widths) -> dict:
        """FineQuant: a group size per projection stack (gate_up or up, and down, of this layer's experts), each
        chosen by the error it causes (``finequant.adaptive_group``) over the stack's sub-8-bit experts. Per stack,
        not per expert: one stack's scales [n, K/g, N, 2] share one group size, which the kernels read in place."""
        out = {}
        for proj, stack in projections(dense).items():
            pairs = [(stack[e].detach(), b) for e, b in enumerate(widths) if b < 8]
            out[proj] = adaptive_group(pairs, stack.shape[-1], self.group_alpha)[0]
        return out
