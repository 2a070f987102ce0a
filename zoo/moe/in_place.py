"""Quantized experts that read their packed weights in place inside a compiled step.

A compiled decode step must not sync with the host, so tensor code reaches the selected experts only by
gathering their weights, which copies each selected expert as many bytes as its matmuls then read. The
op here is opaque to the compiler (``torch.library.custom_op``): inside, plain eager code reads the expert
ids on the host (free on CPU) and runs torch's int8/int4 kernels on views of the selected experts, as
llama.cpp's indexed matmul does. The graph around it stays one graph. It has no autograd, so it serves
inference (``torch.no_grad``) only. Dense experts keep the gather: there, inductor's batched matmul over
the gathered weights measured faster than torch's eager one-row matmul on the views.
"""
from __future__ import annotations

from typing import Optional

import torch

from zoo.moe import kernels
from zoo.moe.cpu_precision import at_matmul_dtype, matmul_dtype
from zoo.moe.dispatch import run_each, run_sorted
from zoo.moe.experts import ACTIVATIONS


PREFILL_ROWS = 16  # from this many rows, an int8 weight converted to the activations' dtype multiplies faster
# from this many bf16 rows, kernels.lowbit_gemm's tiles beat torch's int8 / int4 kernels (one [5632, 1024] matrix,
# 2 threads: int4 0.64 against 0.68 ms at 8 rows, 0.70 against 1.00 at 12; int8 1.04 against 1.08 at 12, 0.96
# against 0.84 at 8); below it torch's low-bit kernels, and for a few tokens zoo::moe_gemv, serve. 2/3-bit codes read
# as stored take the tiles from one row: against dequantize_packed and a bf16 matmul 7.2 / 6.7 / 3.6x (2 bits) and
# 8.9 / 8.5 / 3.4x (3 bits) at 1 / 4 / 32 rows (the same matrix, g = 64, AMD Zen 5, interleaved)
TILE_ROWS = {8: 12, 4: 8, 3: 1, 2: 1}


def kernel_linear(x, q, scale, bits: int, group_size: int) -> torch.Tensor:
    """x [n, K] @ W.T on torch's kernel for an int8 or int4-packed W (no autograd; a 2/3-bit W read as stored goes
    through lowbit_gemm's tiles on bf16 inputs, else is dequantised). Many rows of int8 (prefill): the weight
    converted to x's dtype and torch's dense matmul, which is compute-efficient where the int8 kernel is not
    (256-token prefill on the 304M benchmark model: 347 -> 1016 tok/s; bf16 1350)."""
    from zoo.moe.packing import dequantize, torch_packs_int4_alike

    if x.device.type != "cpu" or bits in (2, 3):
        # these packed kernels are CPU int4/int8 ones: elsewhere, and for 2/3-bit codes read as stored (no int4 working
        # copy: kernels.reads_stored_codes), the dequantized weight's matmul (on the CPU dequantised by the zoo's kernel)
        xd, = at_matmul_dtype(x)
        if (x.shape[0] >= TILE_ROWS[bits] and q.is_contiguous() and scale.is_contiguous()
                and kernels.lowbit_gemm_fits(x, q, bits, group_size)):
            # bf16 inputs: each block of the codes dequantised into a tile in the cache and multiplied there
            return kernels.lowbit_gemm(x.contiguous(), q, scale, bits, group_size)
        if x.device.type == "cpu" and kernels.ready() and q.is_contiguous() and scale.is_contiguous():
            w = kernels.dequantize_packed(q, scale, bits, group_size, xd.dtype)
        else:
            w = dequantize(bits, q, scale, (q.shape[0], x.shape[-1]), group_size).to(xd.dtype)
        return torch.nn.functional.linear(xd, w).to(x.dtype)
    if bits == 8 and x.shape[0] >= PREFILL_ROWS and kernels.int8_inputs_on() and kernels.isa() == "avx512-bf16":
        # the inputs rounded to 8 bits as the decode kernel rounds them, on torch's int8 matrix product (VNNI):
        # 1.8-2.3x a bf16 matmul of the same shape, measured on the 304M model's experts. Without VNNI (the avx2
        # set) torch's int8 product is slow: the 304M model's int8 prefill took 1.6 s at 64 tokens against 0.31
        xq, xs = kernels.int8_input_rows(x)
        return (torch._int_mm(xq, q.t()).float() * xs * scale.float()).to(x.dtype)
    if x.shape[0] >= TILE_ROWS.get(bits, PREFILL_ROWS) and kernels.lowbit_gemm_fits(x, q, bits, group_size):
        # bf16 inputs: each block of W widened into a tile in the cache and multiplied there (no bf16 copy of W)
        return kernels.lowbit_gemm(x.contiguous(), q, scale, bits, group_size)
    dense = matmul_dtype(x.dtype)
    if bits == 8 and x.shape[0] >= PREFILL_ROWS:
        # int8 codes are exact in bf16/fp32, so the per-row scale can wait for the output: one pass over W
        return (torch.nn.functional.linear(x.to(dense), q.to(dense)) * scale.to(dense)).to(x.dtype)
    if bits == 8:
        return torch.ops.aten._weight_int8pack_mm(x, q, scale.to(x.dtype))
    dense_ok = kernels.ready() and x.dtype in (torch.float32, torch.bfloat16)
    if (x.shape[0] >= PREFILL_ROWS or not torch_packs_int4_alike()) and dense_ok:
        # int4 too: dequantised by the zoo's kernel straight into the layout the dense matmul reads best (and where
        # torch's int4 kernel would misread the stored pack, below, whatever the rows)
        w = kernels.dequantize_int4(q, scale, group_size, dense)
        return torch.nn.functional.linear(x.to(dense), w).to(x.dtype)
    if not torch_packs_int4_alike():
        w = dequantize(4, q, scale, (q.shape[0], x.shape[-1]), group_size).to(dense)
        return torch.nn.functional.linear(x.to(dense), w).to(x.dtype)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, q, group_size, scale.to(x.dtype))


def _group(scale: torch.Tensor, x: torch.Tensor, default: int) -> int:
    """A stack's group size from its scale/zero shape [S, K/g, N, 2] (the two projections may differ); int8's
    per-row scales [S, N] have none."""
    return x.shape[-1] // scale.shape[1] if scale.dim() == 4 else default


def _glu(h: torch.Tensor, activation: str, limit: float, alpha: float) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return ACTIVATIONS[activation](gate, up, limit, alpha)


@torch.library.custom_op("zoo::lowbit_experts", mutates_args=())
def lowbit_experts(hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, stacks: list[torch.Tensor],
                   widths: list[int], kernel_bits: list[int], width_of: torch.Tensor, slot_of: torch.Tensor,
                   group_size: int, gate_up_bias: Optional[torch.Tensor], down_bias: Optional[torch.Tensor],
                   activation: str, limit: float, alpha: float) -> torch.Tensor:
    """Packed low-bit experts. ``stacks`` holds, per width ``widths[w]``, ``(gate_up q, gate_up scale,
    down q, down scale)`` as torch's int8/int4 kernels read them (``kernel_bits[w]``); expert e has width
    ``width_of[e]`` and sits at ``slot_of[e]`` of its width's stack. (Per-expert tables travel as tensors:
    Python lists would cost the compiled step a guard per element.)"""
    stack_of = [widths.index(b) for b in width_of.tolist()]
    slot = slot_of.tolist()

    def expert(e, x):
        w, j = stack_of[e], slot[e]
        gq, gs, dq, ds = stacks[4 * w: 4 * w + 4]
        h = kernel_linear(x, gq[j], gs[j], kernel_bits[w], _group(gs, x, group_size))
        if gate_up_bias is not None:
            h = h + gate_up_bias[e]
        a = _glu(h, activation, limit, alpha)
        y = kernel_linear(a, dq[j], ds[j], kernel_bits[w], _group(ds, a, group_size))
        return y if down_bias is None else y + down_bias[e]

    if indices.numel() > len(slot):
        return run_sorted(hidden, indices, weights, len(slot), expert)
    return run_each(hidden, indices, weights, len(slot), expert)


@lowbit_experts.register_fake
def _(hidden, indices, weights, stacks, widths, kernel_bits, width_of, slot_of, group_size, gate_up_bias, down_bias,
      activation, limit, alpha):
    return torch.empty_like(hidden)
