"""quantize: weight-only low-bit experts (packed int8 / int4, torch's CPU kernels) with a bit allocation:
``uniform``, ``pmq`` (MC#, needs calibration) or ``alphaq`` (AlphaQ, no calibration)."""
import numpy as np
import torch

from zoo import Compressor
from zoo import calibration as calib
from zoo.layout import moe_layers
from zoo.moe.experts import SwiGLUExperts
from zoo.moe.quantized import QuantizedExperts, dequantize, quantize_int4, quantize_int8
from zoo.stats import collect

from zoo_compressors.allocation import HIGH, LOW, alphaq, esd_alpha, pmq
from zoo_compressors.base import _tokenizer_for

ALLOCATIONS = ("uniform", "pmq", "alphaq", "random")  # random: the same budget spent blindly (a baseline)


def relative_error(w: torch.Tensor, bits: int, group_size: int) -> float:
    """||W - Q(W)||^2 / ||W||^2 for one weight at ``bits``."""
    if bits == 8:
        q, s = quantize_int8(w)
        deq = dequantize(8, q, s, w.shape, group_size)
    else:
        q, s, codes = quantize_int4(w, group_size)
        deq = dequantize(4, q, s, w.shape, group_size, codes=codes)
    return float((w.float() - deq).pow(2).sum() / w.float().pow(2).sum().clamp(min=1e-30))


class Quantize(Compressor):
    name = "quantize"
    summary = "Packed int8/int4 experts with real low-bit kernels; bits allocated uniformly, by PMQ (MC#) or AlphaQ."
    paper = ("Huang et al., MC#: Mixture Compressor for Mixture-of-Experts Large Models, 2025, arXiv:2510.10962 "
             "(PMQ); AlphaQ: Calibration-Free Bit Allocation for MoE Quantization, 2026")
    card = "cards/quantize.md"
    space = "compression-lab"

    def __init__(self, bits: float = 8, allocation: str = "uniform", group_size: int = 64):
        if allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {allocation!r}")
        if not isinstance(bits, (int, float)) or not LOW <= bits <= HIGH:
            raise ValueError(f"bits (average bits per expert weight) must be in [{LOW}, {HIGH}]: torch has CPU "
                             f"kernels for int4 and int8 weights; got {bits!r}")
        if allocation == "uniform" and bits not in (LOW, HIGH):
            raise ValueError(f"uniform allocation needs bits={LOW} or {HIGH}; use pmq or alphaq for {bits}")
        if not isinstance(group_size, int) or group_size < 32 or group_size % 32:
            raise ValueError(f"group_size must be a positive multiple of 32, got {group_size!r}")
        super().__init__(bits=bits, allocation=allocation, group_size=group_size)
        self.bits, self.allocation, self.group_size = bits, allocation, group_size
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
            rng = np.random.default_rng(0)
            bits = np.full(len(flat), LOW)
            bits[rng.permutation(len(flat))[: int((self.bits - LOW) / (HIGH - LOW) * len(flat) + 1e-9)]] = HIGH
        elif self.allocation == "alphaq":
            alphas = np.array([np.mean([esd_alpha(w) for w in weights[key]]) for key in flat])
            self.results["alpha"] = [round(float(a), 3) for a in alphas]
            bits = alphaq(alphas, sizes, self.bits)
        else:
            if data is None:
                data = calib.corpus("mixed", tokens=8192)
            stats = collect(model, calib.batches(data, _tokenizer_for(model)), desc="pmq: expert significance")
            by_layer = {st.layer: st for st in stats}
            # MC#: significance from how often an expert is activated and how much weight it then gets
            sig = np.array([float(by_layer[i].frequency[e] * by_layer[i].gate_sum[e] / max(1, by_layer[i].counts[e]))
                            for i, e in flat])
            err = {b: np.array([sum(relative_error(w, b, self.group_size) for w in weights[key]) for key in flat])
                   for b in (LOW, HIGH)}
            bits = pmq(sig, err[LOW], err[HIGH], sizes, self.bits)
        out: dict[int, list[int]] = {i: [] for i, _ in layers}
        for (i, _), b in zip(flat, bits):
            out[i].append(int(b))
        return out
