"""Dense bit packing of 2- and 3-bit codes into bytes (the on-disk and in-memory storage), and ``dequantize``: the
float weight any packed one stands for, the reference every kernel is tested against.

2 bits: four codes per byte. 3 bits: eight codes in three bytes (one 24-bit word, little end first).
Rows are packed independently, so a weight [N, K] becomes uint8 [N, K * bits / 8].
"""
from __future__ import annotations

import torch


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [N, K] integers in [0, 2**bits) -> uint8 [N, K * bits // 8]."""
    n, k = codes.shape
    per_word = {2: 4, 3: 8}[bits]
    if k % per_word:
        raise ValueError(f"{bits}-bit packing needs K divisible by {per_word}, got {k}")
    c = codes.to(torch.int32).view(n, k // per_word, per_word)
    shifts = torch.arange(per_word, dtype=torch.int32, device=codes.device) * bits
    word = (c << shifts).sum(-1)  # [N, K/per_word], fits in 24 bits
    nbytes = per_word * bits // 8
    out = torch.stack([(word >> (8 * i)) & 0xFF for i in range(nbytes)], -1)
    return out.to(torch.uint8).view(n, k * bits // 8)


def unpack(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """uint8 [N, K * bits // 8] -> int32 codes [N, K]."""
    n = packed.shape[0]
    per_word = {2: 4, 3: 8}[bits]
    nbytes = per_word * bits // 8
    b = packed.to(torch.int32).view(n, k // per_word, nbytes)
    word = (b << (8 * torch.arange(nbytes, dtype=torch.int32, device=packed.device))).sum(-1)
    shifts = torch.arange(per_word, dtype=torch.int32, device=packed.device) * bits
    return ((word[..., None] >> shifts) & ((1 << bits) - 1)).view(n, k).to(torch.int32)


def int4pack(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] int32 in [0, 16) -> torch's CPU int4 pack (uint8 [N, K/2]), the stored 4-bit form; codes on
    another device are packed on the host (the op is CPU-only) and the pack returned to their device."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.cpu(), 1)
    return packed.to(codes.device)


def dequantize(bits: int, q: torch.Tensor, scale: torch.Tensor, shape, group_size: int, codes=None):
    """The float weight a packed one stands for (the reference every kernel is tested against)."""
    n, k = shape
    if bits == 8:
        return q.float() * scale.float()[:, None]
    if codes is None and bits in (2, 3):
        codes = unpack(q, bits, k)
    if codes is None:  # unpack by multiplying the identity: exact, and needs no knowledge of the pack layout
        eye = torch.eye(k, dtype=torch.float32)
        # torch's int4 pack is a CPU layout with a CPU kernel: another device's copy is unpacked on the host
        w_t = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, q.cpu(), group_size, scale.float().cpu())
        return w_t.t().contiguous().to(q.device)
    sz = scale.float()
    s, z = sz[..., 0].t(), sz[..., 1].t()  # [N, K/g]
    return ((codes.view(n, k // group_size, group_size).float() - 8) * s[..., None] + z[..., None]).view(n, k)
