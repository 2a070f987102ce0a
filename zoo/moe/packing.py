"""Dense bit packing of 2- and 3-bit codes into bytes (the on-disk and in-memory storage), and ``dequantize``: the
float weight any packed one stands for, the reference every kernel is tested against.

2 bits: four codes per byte. 3 bits: eight codes in three bytes (one 24-bit word, little end first).
Rows are packed independently, so a weight [N, K] becomes uint8 [N, K * bits / 8]. 4 bits: ``int4pack``, torch's
CPU int4 layout, fixed to one form whatever processor packs it.
"""
from __future__ import annotations

import functools

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


INT4_BLOCK = 64  # rows per block of the stored int4 form


def int4pack(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] integers in [0, 16) -> the stored 4-bit form, uint8 [N, K/2]: torch's CPU int4 pack as its
    AVX-512 build lays it out, on every machine. Blocks of 64 rows, k-major: for each k 32 bytes, byte j holding row
    j (low nibble) and row j + 32 (high); the rows past the last full block two to a byte per k (row 2j low, 2j + 1
    high). torch's own op lays its pack out by the processor it runs on (blocks of 32 rows on an AVX2-only
    machine), so a pack made by it would read differently elsewhere: this one is the same bytes everywhere."""
    n, k = codes.shape
    if n % 16 or k % 2:
        raise ValueError(f"the int4 pack needs N divisible by 16 and K even, got [{n}, {k}]")
    c = codes.to(torch.uint8)
    full = n // INT4_BLOCK * INT4_BLOCK
    blocks = c[:full].view(-1, INT4_BLOCK, k).transpose(1, 2)  # [B, K, 64]
    half = INT4_BLOCK // 2
    body = blocks[..., :half] | (blocks[..., half:] << 4)
    tail = (c[full::2] | (c[full + 1::2] << 4)).t()  # [K, (N - full) / 2]
    return torch.cat([body.reshape(-1), tail.reshape(-1)]).view(n, k // 2)


def int4unpack(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The stored 4-bit form uint8 [N, K/2] -> int32 codes [N, K] (int4pack's inverse)."""
    n = packed.shape[0]
    flat = packed.reshape(-1)
    full = n // INT4_BLOCK * INT4_BLOCK
    body = flat[:full * k // 2].view(-1, k, INT4_BLOCK // 2)  # [B, K, 32]
    blocks = torch.cat([body & 15, body >> 4], -1).transpose(1, 2).reshape(full, k)
    tail = flat[full * k // 2:].view(k, (n - full) // 2).t()  # [(N - full) / 2, K]
    rows = torch.stack([tail & 15, tail >> 4], 1).reshape(n - full, k)
    return torch.cat([blocks, rows]).to(torch.int32)


@functools.cache
def _torch_int4_layout_matches() -> bool:
    codes = (torch.arange(INT4_BLOCK * 2, dtype=torch.int32) // 4 % 16)[:, None].expand(-1, 64).contiguous()
    return torch.equal(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), int4pack(codes))


@torch.compiler.assume_constant_result
def torch_packs_int4_alike() -> bool:
    """Whether torch's own int4 op (``_convert_weight_to_int4pack_for_cpu``, and so ``_weight_int4pack_mm_for_cpu``)
    lays packs out as ``int4pack`` does on this machine (its AVX-512 build does; an AVX2-only one packs blocks of 32
    rows): where it does not, torch's int4 matmul cannot read the stored form. Probed once per process; a constant
    to the compiler (compiled steps ask it too)."""
    return _torch_int4_layout_matches()


def dequantize(bits: int, q: torch.Tensor, scale: torch.Tensor, shape, group_size: int, codes=None):
    """The float weight a packed one stands for (the reference every kernel is tested against)."""
    n, k = shape
    if bits == 8:
        return q.float() * scale.float()[:, None]
    if codes is None:
        codes = unpack(q, bits, k) if bits in (2, 3) else int4unpack(q, k)
    sz = scale.float()
    s, z = sz[..., 0].t(), sz[..., 1].t()  # [N, K/g]
    return ((codes.view(n, k // group_size, group_size).float() - 8) * s[..., None] + z[..., None]).view(n, k)
