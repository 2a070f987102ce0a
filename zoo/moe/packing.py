"""Dense bit packing of 2- and 3-bit codes into bytes (the on-disk and in-memory storage).

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
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
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
    word = (b << (8 * torch.arange(nbytes, dtype=torch.int32))).sum(-1)
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
    return ((word[..., None] >> shifts) & ((1 << bits) - 1)).view(n, k).to(torch.int32)
