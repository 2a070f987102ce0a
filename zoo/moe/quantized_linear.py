"""A plain linear layer (attention projection, dense MLP, shared expert, LM head) with packed low-bit weights.

The same storage and kernels as the quantized experts (``zoo.moe.quantized``), for one matrix:
  * 8 bits: ``weight_int8 [N, K]`` with ``weight_scale [N]`` (one scale per output row);
  * 4 bits: torch's CPU int4 pack ``weight_int4 [N, K/2]`` with ``weight_scale_zero [K/g, N, 2]`` (bf16).
A compiled few-token inference step reads it with ``zoo::moe_gemv`` as a one-expert stack; elsewhere it runs on
torch's int8/int4 kernels (prefill: converted to the activations' dtype, as the experts do). Inputs get
gradients through the dequantized weight; the packed weight is frozen. ``zoo_spec()`` records it in
``config.zoo_modules``, so ``from_pretrained`` rebuilds it (``Quantize.build_module``).
"""
from __future__ import annotations

import torch
from torch import nn

from zoo.moe import kernels
from zoo.moe.init import refuse_missing
from zoo.moe.quantized import dequantize, lowbit_linear, quantize_grouped, quantize_int8

LINEAR_BITS = (4, 8)  # the widths torch's kernels and zoo::moe_gemv read in place (2/3 bits are experts-only)


class QuantizedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int = 64, bias: bool = False):
        super().__init__()
        if bits not in LINEAR_BITS:
            raise ValueError(f"a quantized linear layer has bits in {LINEAR_BITS}, got {bits!r}")
        if bits < 8 and (group_size % 32 or group_size < 32 or in_features % group_size):
            raise ValueError(f"group_size must be a multiple of 32 dividing in_features={in_features}, got {group_size}")
        self.in_features, self.out_features, self.bits, self.group_size = in_features, out_features, bits, group_size
        if bits == 8:
            self.register_buffer("weight_int8", torch.zeros(out_features, in_features, dtype=torch.int8))
            self.register_buffer("weight_scale", torch.ones(out_features))
        else:
            self.register_buffer("weight_int4", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
            self.register_buffer("weight_scale_zero", torch.zeros(in_features // group_size, out_features, 2,
                                                                  dtype=torch.bfloat16))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, bits: int, group_size: int = 64,
                    symmetric: bool = False) -> QuantizedLinear:
        """``symmetric``: a 4-bit weight as ``w = q s`` (``quantize_symmetric``); int8 is symmetric anyway."""
        new = cls(linear.in_features, linear.out_features, bits, group_size, bias=linear.bias is not None)
        w = linear.weight.detach()
        q, s = quantize_int8(w) if bits == 8 else quantize_grouped(w, group_size, 4, symmetric)[:2]
        new.packed[0].copy_(q)
        new.packed[1].copy_(s)
        if linear.bias is not None:
            new.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
        return new

    @property
    def packed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, scales) as stored: int8 codes and row scales, or the int4 pack and its scale/zero."""
        if self.bits == 8:
            return self.weight_int8, self.weight_scale
        return self.weight_int4, self.weight_scale_zero

    def dequantized(self) -> torch.Tensor:
        """The float weight ``[N, K]`` it stands for (the reference the kernels are tested against)."""
        q, s = self.packed
        return dequantize(self.bits, q, s, (self.out_features, self.in_features), self.group_size)

    def zoo_spec(self) -> dict:
        return {"compressor": "quantize", "in_features": self.in_features, "out_features": self.out_features,
                "bits": self.bits, "group_size": self.group_size, "bias": self.bias is not None}

    def init_weights(self, std: float) -> None:
        """Packed codes cannot be initialised meaningfully: a load that lacks them fails with their names."""
        refuse_missing(self, [n for n, _ in self.named_buffers(recurse=False)])
        if self.bias is not None and not getattr(self.bias, "_is_hf_initialized", False):
            self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, s = self.packed
        rows = x.numel() // x.shape[-1]
        # eager: one row (torch's int8/int4 matmuls win from a few rows on: [1024 | 8192, 1024] weights, 2 threads,
        # the kernel 1.3-2.1x their speed at one row, 0.85-1.2x at four), or a prompt's rows on int8 dot products or
        # on the avx2 set
        few = (rows <= kernels.MAX_TOKENS if torch.compiler.is_compiling()
               else rows == 1 or self._on_int8_dots(rows, x.dtype) or self._on_avx2_rows(rows))
        if (few and kernels.ready() and not torch.is_grad_enabled() and x.device.type == "cpu"
                and x.dtype in (torch.float32, torch.bfloat16)):
            one = torch.zeros(rows, 1, dtype=torch.long, device=x.device)  # every row reads "expert" 0
            y = kernels.moe_gemv(x.reshape(rows, x.shape[-1]), one, q.unsqueeze(0), s.unsqueeze(0), self.bits,
                                 self.group_size).view(*x.shape[:-1], self.out_features)
        else:
            y = lowbit_linear(x, q, s, self.bits, self.group_size, (self.out_features, self.in_features))
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _on_int8_dots(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether an eager call on ``rows`` rows (prefill) takes the kernel with 8-bit inputs
        (``kernels.int8_inputs(True)``, on the set that has int8 dot products): up to ``kernels.int8_dot_limit`` rows
        for this width and dtype, where its integer dots beat the exact path (bf16 int4: lowbit_gemm's tiles; fp32:
        dequantising) or torch's int8 matmuls (int8)."""
        return (kernels.int8_inputs_on() and rows <= kernels.int8_dot_limit("linear", self.bits, dtype)
                and kernels.isa() in kernels.INT8_DOT_ISAS
                and all(t.is_contiguous() for t in self.packed))

    def _on_avx2_rows(self, rows: int) -> bool:
        """Whether an eager call on ``rows`` rows of exact inputs takes the kernel on the avx2 set: up to
        ``kernels.LINEAR_ROWS_AVX2`` rows for this width."""
        return (rows <= kernels.LINEAR_ROWS_AVX2.get(self.bits, 1) and kernels.ready() and not kernels.int8_inputs_on()
                and kernels.isa() == "avx2")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}"
                + (f", group_size={self.group_size}" if self.bits < 8 else ""))
