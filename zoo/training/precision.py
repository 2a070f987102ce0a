"""The precision training steps run in: bf16 autocast over fp32 master weights where the processor multiplies bf16
natively (AVX-512 CPUs through oneDNN, GPUs), fp32 where it does not. On an AVX2-only CPU torch's bf16 matrix
products take a slow path: one step of fine-tuning zoo-tiny-moe took 32 s under bf16 autocast there, its [2048, 8192]
x [8192, 256] product alone 11 s against 0.11 s in fp32."""
from __future__ import annotations

import torch


def bf16_is_fast(device_type: str = "cpu") -> bool:
    """Whether bf16 autocast speeds up matrix products on ``device_type`` (every accelerator is taken to)."""
    if device_type != "cpu":
        return True
    from zoo.moe.cpu_precision import bf16_matmul_is_native

    return bf16_matmul_is_native()


def use_bf16(bf16: bool | None, device_type: str = "cpu") -> bool:
    """``bf16`` as given, or (None) whether it is fast on ``device_type``."""
    return bf16_is_fast(device_type) if bf16 is None else bool(bf16)


def training_autocast(bf16: bool | None = None, device_type: str = "cpu"):
    """``torch.autocast`` to bf16 when ``use_bf16(bf16)``, disabled (fp32) otherwise."""
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=use_bf16(bf16, device_type))


def precision_label(bf16: bool | None = None, device_type: str = "cpu") -> str:
    """What a report says the steps ran in."""
    return "bf16 autocast" if use_bf16(bf16, device_type) else "fp32 (bf16 is not native here)"
