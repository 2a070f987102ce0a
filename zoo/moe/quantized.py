"""Quantized experts: real packed low-bit weights and torch's own CPU low-bit matmul kernels.

Per expert and projection, a weight ``W [N, K]`` is stored as
  * 8 bits: ``int8 [N, K]`` with one scale per output channel (torch's int8 kernel is per-channel);
  * 4 bits: torch's CPU int4 pack (``uint8 [N, K/2]``) with a bf16 scale and zero per ``group_size`` inputs.
Experts in one layer may use different bit widths (mixed-precision allocation). Inputs get gradients
(through the dequantized weight); the packed weights are frozen.
"""
from __future__ import annotations

import torch

from zoo.moe.experts import SwiGLUExperts

BITS = (4, 8)


def quantize_int8(w: torch.Tensor):
    scale = (w.abs().amax(1).float() / 127).clamp(min=1e-12)
    q = torch.round(w.float() / scale[:, None]).clamp(-128, 127).to(torch.int8)
    return q, scale


def quantize_int4(w: torch.Tensor, group_size: int):
    """Asymmetric per-group 4-bit codes (0..15); returns the packed weight and [K/g, N, 2] scale/zero."""
    n, k = w.shape
    g = w.float().view(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    # the kernel computes (q - 8) * scale + zero, so zero = lo + 8 * scale
    scale_zero = torch.stack([scale.t(), (lo + 8 * scale).t()], -1).to(torch.bfloat16).contiguous()
    return packed, scale_zero, q


def dequantize(bits: int, q: torch.Tensor, scale: torch.Tensor, shape, group_size: int, codes=None):
    """The float weight a packed one stands for (the reference every kernel is tested against)."""
    n, k = shape
    if bits == 8:
        return q.float() * scale.float()[:, None]
    if codes is None:  # unpack by multiplying the identity: exact, and needs no knowledge of the pack layout
        eye = torch.eye(k, dtype=torch.float32)
        w_t = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, q, group_size, scale.float())
        return w_t.t().contiguous()
    sz = scale.float()
    s, z = sz[..., 0].t(), sz[..., 1].t()  # [N, K/g]
    return ((codes.view(n, k // group_size, group_size).float() - 8) * s[..., None] + z[..., None]).view(n, k)


class _LowBitLinear(torch.autograd.Function):
    """y = x @ W.T with a packed W; backward gives x its gradient through the dequantized weight."""

    @staticmethod
    def forward(ctx, x, q, scale, bits, group_size, shape):
        ctx.save_for_backward(q, scale)
        ctx.meta = (bits, group_size, shape)
        if bits == 8:
            return torch.ops.aten._weight_int8pack_mm(x, q, scale.to(x.dtype))
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, q, group_size, scale.to(x.dtype))

    @staticmethod
    def backward(ctx, grad):
        q, scale = ctx.saved_tensors
        bits, group_size, shape = ctx.meta
        w = dequantize(bits, q, scale, shape, group_size).to(grad.dtype)
        return grad @ w, None, None, None, None, None


def lowbit_linear(x, q, scale, bits, group_size, shape):
    lead = x.shape[:-1]
    y = _LowBitLinear.apply(x.reshape(-1, x.shape[-1]).contiguous(), q, scale, bits, group_size, tuple(shape))
    return y.view(*lead, shape[0])


class QuantizedExperts(SwiGLUExperts):
    """SwiGLU experts with packed low-bit weights; ``bits`` gives each expert's width (4 or 8)."""

    name = "quantized"
    summary = "Weight-only packed int8 / int4 experts with torch's CPU low-bit kernels, mixed widths per expert."
    card = "cards/quantize.md"
    space = "compression-lab"

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, bits, group_size: int = 64,
                 activation: str = "silu", bias: bool = False, swiglu_limit: float = 7.0, swiglu_alpha: float = 1.702):
        torch.nn.Module.__init__(self)
        bits = [int(b) for b in (bits if isinstance(bits, (list, tuple)) else [bits] * num_experts)]
        if len(bits) != num_experts or any(b not in BITS for b in bits):
            raise ValueError(f"bits must be {num_experts} values from {BITS}, got {bits}")
        for name, k in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if k % group_size or group_size % 32 or group_size < 32:
                raise ValueError(f"group_size must be a multiple of 32 dividing {name}={k}, got {group_size}")
        from zoo.moe.experts import ACTIVATIONS

        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.activation, self.swiglu_limit, self.swiglu_alpha = activation, swiglu_limit, swiglu_alpha
        self._act = ACTIVATIONS[activation]
        self.bits, self.group_size = bits, group_size
        self.shapes = {"gate_up": (2 * intermediate_size, hidden_size), "down": (hidden_size, intermediate_size)}
        for e, b in enumerate(bits):
            for proj, (n, k) in self.shapes.items():
                if b == 8:
                    self.register_buffer(f"{proj}_q{e}", torch.zeros(n, k, dtype=torch.int8))
                    self.register_buffer(f"{proj}_s{e}", torch.ones(n))
                else:
                    self.register_buffer(f"{proj}_q{e}", torch.zeros(n, k // 2, dtype=torch.uint8))
                    self.register_buffer(f"{proj}_s{e}", torch.zeros(k // group_size, n, 2, dtype=torch.bfloat16))
        self.gate_up_proj_bias = torch.nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size)) if bias else None
        self.down_proj_bias = torch.nn.Parameter(torch.zeros(num_experts, hidden_size)) if bias else None

    @classmethod
    @torch.no_grad()
    def from_dense(cls, experts: SwiGLUExperts, bits, group_size: int = 64) -> "QuantizedExperts":
        opts = experts.options()
        new = cls(bits=bits, group_size=group_size, **opts)
        for e, b in enumerate(new.bits):
            for proj, weight in (("gate_up", experts.gate_up_proj[e]), ("down", experts.down_proj[e])):
                if b == 8:
                    q, s = quantize_int8(weight)
                else:
                    q, s, _ = quantize_int4(weight, group_size)
                getattr(new, f"{proj}_q{e}").copy_(q)
                getattr(new, f"{proj}_s{e}").copy_(s)
        for name in ("gate_up_proj_bias", "down_proj_bias"):
            if getattr(experts, name) is not None:
                getattr(new, name).copy_(getattr(experts, name))
        return new

    def options(self) -> dict:
        opts = super().options()
        opts.update(bits=list(self.bits), group_size=self.group_size)
        return opts

    def dequantized(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) in float: the reference for expert e."""
        return tuple(dequantize(self.bits[e], getattr(self, f"{p}_q{e}"), getattr(self, f"{p}_s{e}"),
                                self.shapes[p], self.group_size) for p in ("gate_up", "down"))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        b1 = None if self.gate_up_proj_bias is None else self.gate_up_proj_bias[e]
        b2 = None if self.down_proj_bias is None else self.down_proj_bias[e]
        h = lowbit_linear(x, getattr(self, f"gate_up_q{e}"), getattr(self, f"gate_up_s{e}"), self.bits[e],
                          self.group_size, self.shapes["gate_up"])
        if b1 is not None:
            h = h + b1
        y = lowbit_linear(self.glu(h), getattr(self, f"down_q{e}"), getattr(self, f"down_s{e}"), self.bits[e],
                          self.group_size, self.shapes["down"])
        return y if b2 is None else y + b2

    def forward(self, hidden, routing):
        return self._forward_sorted(hidden, routing)  # per-expert kernels; the compiled gather path is dense-only

    def num_parameters(self) -> int:
        """Weights represented (as for dense experts); ``nbytes`` is what they really take."""
        n = self.num_experts * 3 * self.hidden_size * self.intermediate_size
        return n + sum(p.numel() for p in (self.gate_up_proj_bias, self.down_proj_bias) if p is not None)
