"""Which dtype CPU matrix products run in. torch multiplies bf16 natively (oneDNN) only on processors with AVX-512;
on an AVX2-only one its bf16 products take a slow path: [16, 1024] x a transposed [5632, 1024] bf16 weight took
192 ms there, a row-major one 9.5, fp32 4.7; an expert's [1701, 256] x [256, 1024] 142 ms in bf16. There the zoo
widens bf16 operands to fp32 for its own products and rounds the outputs back: the experts, kernel-read linear
layers, and (opt in: ``widen_bf16_linears``) a model's plain linear layers."""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn


@torch.compiler.assume_constant_result
def bf16_matmul_is_native() -> bool:
    """Whether torch's CPU matmuls run bf16 natively here."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def matmul_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a CPU product of ``dtype`` operands runs in: their own, except bf16 where torch's bf16 matmuls are
    not native (fp32 there, the output rounded back to bf16)."""
    return torch.float32 if dtype == torch.bfloat16 and not bf16_matmul_is_native() else dtype


def at_matmul_dtype(x: torch.Tensor, *tensors):
    """``x`` and ``tensors`` (None stays None) in the dtype ``x``'s products run in on its device (see
    ``matmul_dtype``; off the CPU, its own). Round the result back with ``.to(x.dtype)``."""
    dtype = matmul_dtype(x.dtype) if x.device.type == "cpu" else x.dtype
    return tuple(None if t is None else t.to(dtype) for t in (x, *tensors))


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """``F.linear`` in the dtype ``x``'s products run in (``at_matmul_dtype``: fp32 for bf16 where torch's bf16
    products are not native), the output in ``x``'s dtype. ``weight`` and ``bias`` may be stored in another dtype."""
    xm, weight, bias = at_matmul_dtype(x, weight, bias)
    return F.linear(xm, weight, bias).to(x.dtype)


class WideningLinear(nn.Linear):
    """``nn.Linear`` whose bf16 product on a CPU without native bf16 products runs in fp32, rounded back to bf16
    (what a native bf16 matmul does too: fp32 sums, one rounding; the order of the sums may differ). Same parameters
    and state dict."""

    zoo_plain_linear = True  # is_plain_linear: the same product as nn.Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def is_plain_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a plain linear layer: ``nn.Linear`` itself or one of the zoo's forwards for it
    (``WideningLinear``, the kernel's ``KernelLinear``: same parameters, same product)."""
    cls = type(module)
    return cls is nn.Linear or cls.__dict__.get("zoo_plain_linear", False)


def widen_bf16_linears(model: nn.Module) -> int:
    """Opt in, where bf16 products are not native: every plain ``nn.Linear`` of ``model`` (attention projections, the
    LM head) takes ``WideningLinear``'s forward by a class swap, also under accelerate's hooks (a device map), so
    results do not depend on the map. How many (0 where bf16 is native: nothing changes). Not done by default: a
    plugin may look for layers whose type is exactly ``nn.Linear``. On an AVX2-only processor zoo-tiny-moe's bf16
    forward over 8 x 256 tokens took 1.0 s with torch's bf16 linears and 0.41 s widened (interleaved, 3 rounds)."""
    if bf16_matmul_is_native():
        return 0
    swapped = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = WideningLinear
            if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward"):  # the hook calls this one
                module._old_forward = types.MethodType(WideningLinear.forward, module)
            swapped += 1
    return swapped
