"""Experts quantized to non-uniform low-bit data types (BitMoD, arXiv:2411.11745, whose claim the ``quantize``
compressor's ``dtype="bitmod"`` records; the types are in ``zoo.moe.bitmod``): 4- or 3-bit codes that index a small
table of values per group's type, one bf16 scale per group, and (BitMoD's mixture) a 2-bit type id per group.

Per expert and projection, a weight ``W [N, K]`` is stored as ``{proj}_codes uint8 [E, N, K*bits/8]``,
``{proj}_scale bf16 [E, N, K/g]`` and ``{proj}_types uint8 [E, N, ceil(K/g/4)]`` (BitMoD only: four 2-bit ids a
byte). The values are not an
affine function of the code, so torch's int4 kernel and ``zoo::moe_gemv`` (``(q - 8) * s + z``) cannot read
them: every path dequantizes through the lookup (``dequantize_bitmod``) and multiplies in float: eager code one
used expert at a time, compiled decode the gathered selected experts. A lookup kernel is future work.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import initialization as init

from zoo.moe.bitmod import (BITMOD_BITS, DTYPES, dequantize_bitmod, pack_codes, pack_types, quantize_bitmod, table,
                             unpack_codes, unpack_types)
from zoo.moe.dispatch import gather_rows, run_sorted
from zoo.moe.experts import SwiGLUExperts
from zoo.moe.init import refuse_missing


class LookupQuantizedExperts(SwiGLUExperts):
    name = "quantized-lookup"
    summary = "Weight-only 3/4-bit experts in non-uniform data types (BitMoD's per-group FP types), read by lookup."
    card = "cards/quantize.md"
    space = "compression-lab"

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, bits: int = 4,
                 group_size: int = 128, dtype: str = "bitmod", activation: str = "silu", bias: bool = False,
                 swiglu_limit: float = 7.0, swiglu_alpha: float = 1.702):
        torch.nn.Module.__init__(self)
        from zoo.moe.experts import ACTIVATIONS

        if bits not in BITMOD_BITS:
            raise ValueError(f"bits must be one of {BITMOD_BITS} for dtype {dtype!r}, got {bits!r}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        for name, k in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if not isinstance(group_size, int) or group_size < 8 or k % group_size or group_size % 8:
                raise ValueError(f"group_size must be a multiple of 8 dividing {name}={k}, got {group_size!r}")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.activation, self.swiglu_limit, self.swiglu_alpha = activation, swiglu_limit, swiglu_alpha
        self._act = ACTIVATIONS[activation]
        self.bits, self.group_size, self.dtype = bits, group_size, dtype
        self.shapes = {"gate_up": (2 * intermediate_size, hidden_size), "down": (hidden_size, intermediate_size)}
        for proj, (n, k) in self.shapes.items():
            self.register_buffer(f"{proj}_codes", torch.zeros(num_experts, n, k * bits // 8, dtype=torch.uint8))
            self.register_buffer(f"{proj}_scale", torch.zeros(num_experts, n, k // group_size, dtype=torch.bfloat16))
            if dtype == "bitmod":
                self.register_buffer(f"{proj}_types", torch.zeros(num_experts, n, -(-k // group_size // 4),
                                                                  dtype=torch.uint8))
        self.register_buffer("values", table(bits, dtype), persistent=False)  # the lookup table (rebuilt, not saved)
        self.gate_up_proj_bias = torch.nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size)) if bias else None
        self.down_proj_bias = torch.nn.Parameter(torch.zeros(num_experts, hidden_size)) if bias else None

    @classmethod
    @torch.no_grad()
    def from_dense(cls, experts: SwiGLUExperts, bits: int = 4, group_size: int = 128,
                   dtype: str = "bitmod") -> LookupQuantizedExperts:
        new = cls(bits=bits, group_size=group_size, dtype=dtype, **experts.options())
        for e in range(experts.num_experts):
            for proj, weight in (("gate_up", experts.gate_up_proj[e]), ("down", experts.down_proj[e])):
                codes, scale, types = quantize_bitmod(weight, group_size, bits, dtype)
                getattr(new, f"{proj}_codes")[e].copy_(pack_codes(codes, bits))
                getattr(new, f"{proj}_scale")[e].copy_(scale)
                if dtype == "bitmod":
                    getattr(new, f"{proj}_types")[e].copy_(pack_types(types))
        for name in ("gate_up_proj_bias", "down_proj_bias"):
            if getattr(experts, name) is not None:
                getattr(new, name).copy_(getattr(experts, name))
        return new

    def init_weights(self, std: float) -> None:
        """Codes, scales and types cannot be initialised meaningfully: a load that lacks one fails with its name."""
        self.values.copy_(table(self.bits, self.dtype))
        refuse_missing(self, [n for n, _ in self.named_buffers(recurse=False) if n != "values"])
        for bias in (self.gate_up_proj_bias, self.down_proj_bias):
            if bias is not None:
                init.zeros_(bias)

    def options(self) -> dict:
        opts = super().options()
        opts.update(bits=self.bits, group_size=self.group_size, dtype=self.dtype)
        return opts

    def weight(self, proj: str, e) -> torch.Tensor:
        """The float32 weight(s) of expert(s) ``e`` (an int, or a 1-d index tensor: a gather) for one projection."""
        k = self.shapes[proj][1]
        codes, scale = getattr(self, f"{proj}_codes")[e], getattr(self, f"{proj}_scale")[e]
        groups = k // self.group_size
        types = None if self.dtype != "bitmod" else unpack_types(getattr(self, f"{proj}_types")[e], groups)
        return dequantize_bitmod(unpack_codes(codes, self.bits, k), scale, types, self.bits, self.group_size,
                                 self.dtype, self.values)

    def type_ids(self, proj: str) -> torch.Tensor:
        """BitMoD's type id of every group of one projection, uint8 [E, N, K/g]."""
        return unpack_types(getattr(self, f"{proj}_types"), self.shapes[proj][1] // self.group_size)

    def dequantized(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) in float: the reference for expert e."""
        return self.weight("gate_up", e), self.weight("down", e)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        b1 = None if self.gate_up_proj_bias is None else self.gate_up_proj_bias[e].to(x.dtype)
        b2 = None if self.down_proj_bias is None else self.down_proj_bias[e].to(x.dtype)
        h = F.linear(x, self.weight("gate_up", e).to(x.dtype), b1)
        return F.linear(self.glu(h), self.weight("down", e).to(x.dtype), b2)

    def forward(self, hidden, routing):
        tokens, k = routing.indices.shape
        if torch.compiler.is_compiling() and tokens * k <= self.num_experts:
            return self._forward_gather(hidden, routing)
        return run_sorted(hidden, routing.indices, routing.weights, self.num_experts, self.expert)

    def _forward_gather(self, hidden, routing):
        """Compiled decode: the selected experts dequantized by gather + lookup (static shapes, no host sync)."""
        idx, valid = gather_rows(routing.indices, self.num_experts)
        k = routing.indices.shape[1]
        x = hidden.repeat_interleave(k, dim=0).unsqueeze(-1)
        h = torch.bmm(self.weight("gate_up", idx).to(hidden.dtype), x).squeeze(-1)
        if self.gate_up_proj_bias is not None:
            h = h + self.gate_up_proj_bias[idx].to(h.dtype)
        y = torch.bmm(self.weight("down", idx).to(hidden.dtype), self.glu(h).unsqueeze(-1)).squeeze(-1)
        if self.down_proj_bias is not None:
            y = y + self.down_proj_bias[idx].to(y.dtype)
        w = torch.where(valid, routing.weights.reshape(-1), 0).to(y.dtype)
        return (y * w[:, None]).view(hidden.shape[0], k, y.shape[-1]).sum(1).to(hidden.dtype)

    def num_parameters(self) -> int:
        """Weights represented (as for dense experts); ``nbytes`` is what they really take."""
        n = self.num_experts * 3 * self.hidden_size * self.intermediate_size
        return n + sum(p.numel() for p in (self.gate_up_proj_bias, self.down_proj_bias) if p is not None)
