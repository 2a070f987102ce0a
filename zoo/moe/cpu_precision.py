"""Which dtype CPU matrix products run in. torch multiplies bf16 natively (oneDNN) only on processors with AVX-512;
on an AVX2-only one its bf16 products take a slow path: [16, 1024] x a transposed [5632, 1024] bf16 weight took
192 ms there, a row-major one 9.5, fp32 4.7; an expert's [1701, 256] x [256, 1024] 142 ms in bf16. There the zoo
widens bf16 operands to fp32 for its own products and rounds the outputs back."""
from __future__ import annotations

import torch


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
