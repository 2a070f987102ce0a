"""Plain linear layers (attention projections, the LM head) read by ``zoo::moe_gemv`` on a few rows.

In one decode step the large one-row matmuls outside the experts ran as library matmuls at a third of the
machine's read bandwidth (profile of the 304M benchmark model: ``aten::mm`` 5.3 ms of a 20 ms step). The kernel
reads a weight as a one-expert stack at memory speed. ``read_linears_with_kernel(model)`` gives a model's plain
``nn.Linear`` layers this forward by a class swap: same parameters and state dict, and outside few-row inference
(a compiled decode step, an eager call on a few rows) ``WideningLinear``'s product (in fp32 for bf16 on a CPU without
native bf16 products: ``zoo.moe.cpu_precision``).
"""
from __future__ import annotations

import torch
from torch import nn

from zoo.moe import kernels
from zoo.moe.cpu_precision import WideningLinear

# Smaller weights (routers) stay in inductor's fused code. Key/value projections of 2^18 elements take the kernel: in
# inductor's code they were a loop of single-row dot products inside the attention's fused kernel (304M model, bf16
# AOT step, interleaved, 40 rounds, two runs: 1.03 / 1.03x; int4, whose projections are not plain linears, 1.006x);
# one [256, 1024] fp32 weight on 1 / 4 / 8 rows: 1.68 / 1.83 / 1.36x the library's matmul.
MIN_WEIGHTS = 1 << 18


# Eagerly (a short prompt's prefill), bf16 weights on bf16 inputs with bf16 dot products take the kernel for as many
# rows as bf16 experts do, and smaller weights too: the library matmul of 16 rows took 312 us ([1024, 1024]) and
# 95 us ([256, 1024]) in the 304M model's prefill. Its bf16 prefill against the former rule (8 rows, weights from
# 2^20), interleaved in one process, 20 rounds: 8 / 16 / 24 tokens 1.06 / 1.05 / 1.03x (an earlier run: 1.06 / 1.01x
# at 16 / 24).
EAGER_MIN_WEIGHTS = 1 << 16


class KernelLinear(WideningLinear):
    """``nn.Linear`` whose few-row inference (a compiled decode step: up to ``kernels.MAX_TOKENS`` rows; eager: up to
    ``kernels.PAIRS_PER_EXPERT``'s bound for its weights, e.g. a short prompt's prefill or the LM head on its last
    position) reads the weight with ``zoo::moe_gemv``."""

    zoo_plain_linear = True  # is_plain_linear: the same product as nn.Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if torch.compiler.is_compiling():
            few, big = rows <= kernels.MAX_TOKENS, self.weight.numel() >= MIN_WEIGHTS
        else:  # bf16 on bf16 dot products (tiles) or on the avx2 set (strips: the 304M model's bf16 prefill,
            # interleaved, 2 threads: 16 tokens 1.12-1.18x the widened matmul, 32: 1.15x, 64: 1.02x) go further
            key = kernels.eager_pairs_key(x, self.weight)
            few = rows <= kernels.PAIRS_PER_EXPERT[key]
            big = self.weight.numel() >= (MIN_WEIGHTS if key == 16 else EAGER_MIN_WEIGHTS)
        if (few and big and kernels.ready() and not torch.is_grad_enabled()
                and x.device.type == "cpu"
                and x.dtype in (torch.float32, torch.bfloat16) and self.weight.is_contiguous()):
            one = torch.zeros(rows, 1, dtype=torch.long, device=x.device)  # every row reads "expert" 0
            y = kernels.moe_gemv(x.reshape(rows, x.shape[-1]), one, self.weight.unsqueeze(0), None, 16)
            y = y.view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        return super().forward(x)  # bf16 widened to fp32 on a CPU without native bf16 products


def read_linears_with_kernel(model: nn.Module) -> int:
    """Swap the class of every plain ``nn.Linear`` in ``model`` to ``KernelLinear`` (idempotent); how many."""
    swapped = 0
    for module in model.modules():
        if type(module) in (nn.Linear, WideningLinear):
            module.__class__ = KernelLinear
            swapped += 1
    return swapped
