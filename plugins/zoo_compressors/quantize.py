"""quantize: weight-only low-bit experts (packed 2/3/4/8-bit, torch's CPU int4/int8 kernels) with a bit
allocation: ``uniform``, ``pmq`` (MC#, needs calibration) or ``alphaq`` (AlphaQ, no calibration)."""
import numpy as np
import torch

from zoo import Compressor
from zoo import calibration as calib
from zoo.layout import moe_layers
from zoo.moe.experts import SwiGLUExperts
from zoo.moe.quantized import (
    BITS,
    QuantizedExperts,
    dequantize,
    quantize_grouped,
    quantize_int8,
)
from zoo.stats import collect
from zoo_compressors.allocation import WIDTHS, allocate, alphaq, esd_alpha, pmq
from zoo_compressors.base import _tokenizer_for

ALLOCATIONS = ("uniform", "pmq", "alphaq", "random")  # random: the same budget spent blindly (a baseline)


def relative_error(w: torch.Tensor, bits: int, group_size: int) -> float:
    """||W - Q(W)||^2 / ||W||^2 for one weight at ``bits``."""
    if bits == 8:
        q, s = quantize_int8(w)
        deq = dequantize(8, q, s, w.shape, group_size)
    else:
        q, s, codes = quantize_grouped(w, group_size, bits)
        deq = dequantize(bits, q, s, w.shape, group_size, codes=codes)
    return float((w.float() - deq).pow(2).sum() / w.float().pow(2).sum().clamp(min=1e-30))


class Quantize(Compressor):
    name = "quantize"
    summary = "Packed 2/3/4/8-bit experts with real low-bit kernels; bits allocated uniformly, by PMQ (MC#) or AlphaQ."
    paper = ("Huang et al., MC#: Mixture Compressor for Mixture-of-Experts Large Models, 2025, arXiv:2510.10962 "
             "(PMQ); AlphaQ: Calibration-Free Bit Allocation for MoE Quantization, 2026")
    card = "cards/quantize.md"
    space = "compression-lab"

    def __init__(self, bits: float = 8, allocation: str = "uniform", group_size: int = 64, widths=WIDTHS):
        if allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {allocation!r}")
        if not isinstance(widths, (list, tuple)) or not widths or any(w not in BITS for w in widths):
            raise ValueError(f"widths must be a list of bit widths from {BITS}, got {widths!r}")
        widths = tuple(sorted({int(w) for w in widths}))
        if not isinstance(bits, (int, float)) or not widths[0] <= bits <= widths[-1]:
            raise ValueError(f"bits (average bits per expert weight) must be in [{widths[0]}, {widths[-1]}] "
                             f"(the widths {list(widths)}); got {bits!r}")
        if allocation == "uniform" and bits not in BITS:
            raise ValueError(f"uniform allocation needs bits in {BITS}; use pmq or alphaq for an average of {bits}")
        if not isinstance(group_size, int) or group_size < 32 or group_size % 32:
            raise ValueError(f"group_size must be a positive multiple of 32, got {group_size!r}")
        super().__init__(bits=bits, allocation=allocation, group_size=group_size, widths=list(widths))
        self.bits, self.allocation, self.group_size, self.widths = bits, allocation, group_size, widths
        self.needs_calibration = allocation == "pmq"
        self.results: dict = {}

    def compress(self, model, calibration=None):
        layers = moe_layers(model)
        for i, moe in layers:
            if type(moe.experts) is not SwiGLUExperts:
                raise ValueError(f"layer {i} has {moe.experts.name!r} experts; quantize needs dense experts")
            for size in (moe.experts.hidden_size, moe.experts.intermediate_size):
                if size % self.group_size:
                    raise ValueError(f"group_size={self.group_size} does not divide layer {i}'s size {size}")
        widths = self.allocate(model, layers, calibration)
        new = {i: QuantizedExperts.from_dense(moe.experts, widths[i], self.group_size) for i, moe in layers}
        for i, moe in layers:
            moe.experts = new[i]
        self.results["bits"] = {str(i): list(map(int, widths[i])) for i, _ in layers}
        return model

    def allocate(self, model, layers, data) -> dict[int, list[int]]:
        if self.allocation == "uniform":
            return {i: [int(self.bits)] * moe.num_experts for i, moe in layers}
        flat = [(i, e) for i, moe in layers for e in range(moe.num_experts)]
        sizes = np.array([3 * moe.experts.hidden_size * moe.experts.intermediate_size
                          for i, moe in layers for _ in range(moe.num_experts)], dtype=float)
        weights = {(i, e): (moe.experts.gate_up_proj[e].detach(), moe.experts.down_proj[e].detach())
                   for i, moe in layers for e in range(moe.num_experts)}
        if self.allocation == "random":
            # the same program with blind inputs: random importance, and the textbook error 2^-2b for all
            rng = np.random.default_rng(0)
            blind = np.tile(2.0 ** (-2 * np.array(self.widths)), (len(flat), 1))
            bits = allocate(rng.random(len(flat)), blind, sizes, self.widths, self.bits)
        else:
            err = np.array([[sum(relative_error(w, b, self.group_size) for w in weights[key]) for b in self.widths]
                            for key in flat])
            if self.allocation == "alphaq":
                alphas = np.array([np.mean([esd_alpha(w) for w in weights[key]]) for key in flat])
                self.results["alpha"] = [round(float(a), 3) for a in alphas]
                bits = alphaq(alphas, err, sizes, self.widths, self.bits)
            else:
                if data is None:
                    data = calib.corpus("mixed", tokens=8192)
                stats = collect(model, calib.batches(data, _tokenizer_for(model)), desc="pmq: expert significance")
                by_layer = {st.layer: st for st in stats}
                # MC#: significance from how often an expert is activated and how much weight it then gets
                sig = np.array([float(by_layer[i].frequency[e] * by_layer[i].gate_sum[e]
                                      / max(1, by_layer[i].counts[e])) for i, e in flat])
                bits = pmq(sig, err, sizes, self.widths, self.bits)
        out: dict[int, list[int]] = {i: [] for i, _ in layers}
        for (i, _), b in zip(flat, bits):
            out[i].append(int(b))
        return out
