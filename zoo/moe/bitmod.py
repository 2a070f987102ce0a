"""BitMoD's mixture of data types (Chen et al., HPCA 2025, arXiv:2411.11745): each group of weights picks, among a few
low-bit floating-point types, the one that quantizes it with the least squared error.

The types are FP4 (E2M1) and FP3 with the code that plain FP wastes on a second zero (-0) given a special value:
  * extra resolution (ER): a value inside the largest gap near the top, +-5 in FP4 (between E2M1's 4 and 6),
    +-3 in FP3 (between 2 and 4);
  * extra asymmetry (EA): a value past the top on one side only, +-8 in FP4 (past 6), +-6 in FP3 (past 4).
The FP4 table is kept times 2 (every E2M1 value an integer), so there ER is +-10 and EA +-16.
With a sign each, four types per width, so a group's type costs 2 bits (four type ids packed in a byte).
A group is scaled symmetrically, scale = max|w| / (the type's largest magnitude), and each weight rounds to the
nearest value of the type. Codes are indices into the type's sorted values (16 at 4 bits, 8 at 3 bits), so a
weight is ``TABLE[bits][type, code] * scale``: one lookup, the reference every fast path is tested against.
"""
from __future__ import annotations

import torch

from zoo.moe.packing import pack, unpack

BITMOD_BITS = (3, 4)
_FP4 = [0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]  # E2M1's magnitudes, times 2 so all are integers
_FP3 = [0.0, 1.0, 2.0, 4.0]
_SPECIAL = {4: {"er": 10.0, "ea": 16.0}, 3: {"er": 3.0, "ea": 6.0}}  # FP4 in the x2 units of _FP4


DTYPES = ("bitmod", "fp")  # fp: plain FP4/FP3 alone (its second zero unused), the single-type baseline
TYPE_NAMES = {"bitmod": ("er+", "er-", "ea+", "ea-"), "fp": ("fp",)}  # ties go to the first type listed


def _type(base, special: float) -> list[float]:
    return sorted([-m for m in base] + [m for m in base[1:]] + [special])  # -0 is the special value's code


def table(bits: int, dtype: str = "bitmod") -> torch.Tensor:
    """[types, 2**bits] float32: the sorted values of each type (rows in ``TYPE_NAMES[dtype]`` order)."""
    base = _FP4 if bits == 4 else _FP3
    sp = _SPECIAL[bits]
    specials = (sp["er"], -sp["er"], sp["ea"], -sp["ea"]) if dtype == "bitmod" else (0.0,)
    return torch.tensor([_type(base, s) for s in specials], dtype=torch.float32)


def quantize_bitmod(w: torch.Tensor, group_size: int, bits: int = 4, dtype: str = "bitmod", types=None):
    """w [N, K] -> (codes int32 [N, K], scale bf16 [N, K/g], type uint8 [N, K/g]): each group's type is the one of
    ``types`` (rows of ``table(bits, dtype)``; default all) with the least squared error, measured with the bf16
    scale that is stored."""
    n, k = w.shape
    tab = table(bits, dtype)
    g = w.detach().float().reshape(n, k // group_size, group_size)
    absmax = g.abs().amax(-1)
    best_err = best_codes = best_scale = best_type = None
    for t in (range(len(tab)) if types is None else types):
        values = tab[t]
        scale = (absmax / values.abs().max()).clamp(min=1e-12).to(torch.bfloat16)
        x = g / scale.float()[..., None]
        codes = torch.bucketize(x, (values[1:] + values[:-1]) / 2)  # nearest value, a tie to the lower one
        err = (values[codes] * scale.float()[..., None] - g).pow(2).sum(-1)
        if best_err is None:
            best_err, best_codes, best_scale = err, codes, scale
            best_type = torch.full_like(err, t, dtype=torch.uint8)
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_codes = torch.where(better[..., None], codes, best_codes)
        best_scale = torch.where(better, scale, best_scale)
        best_type = torch.where(better, torch.full_like(best_type, t), best_type)
    return best_codes.reshape(n, k).to(torch.int32), best_scale, best_type


def dequantize_bitmod(codes: torch.Tensor, scale: torch.Tensor, types: torch.Tensor | None, bits: int,
                      group_size: int, dtype: str = "bitmod", values: torch.Tensor | None = None) -> torch.Tensor:
    """codes [..., N, K] -> float32 [..., N, K]: the lookup ``table[type, code] * scale`` per group (types None:
    a single-type dtype). ``values``: ``table(bits, dtype)`` as the caller holds it (a module's buffer, which an
    exported graph reads as the module's tensor rather than a constant made while tracing)."""
    *lead, n, k = codes.shape
    tab = (table(bits, dtype) if values is None else values).to(codes.device).reshape(-1)
    per = 2 ** bits
    c = codes.reshape(*lead, n, k // group_size, group_size).long()
    index = c if types is None else types.long()[..., None] * per + c
    w = tab[index] * scale.float()[..., None]
    return w.reshape(*lead, n, k)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int codes [N, K] -> uint8 [N, K * bits / 8]: two 4-bit codes a byte (even k in the low nibble), or the zoo's
    dense 3-bit packing (``zoo.moe.packing``)."""
    if bits == 3:
        return pack(codes, 3)
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_codes(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """uint8 [..., N, K * bits / 8] -> int32 codes [..., N, K]."""
    if bits == 3:
        lead = packed.shape[:-1]
        return unpack(packed.reshape(-1, packed.shape[-1]), 3, k).reshape(*lead, k)
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack([lo, hi], -1).reshape(*packed.shape[:-1], k).to(torch.int32)


def pack_types(types: torch.Tensor) -> torch.Tensor:
    """type ids uint8 [..., G] in 0..3 -> uint8 [..., ceil(G / 4)]: four 2-bit ids a byte (the first lowest)."""
    pad = -types.shape[-1] % 4
    t = torch.nn.functional.pad(types.to(torch.uint8), (0, pad)).reshape(*types.shape[:-1], -1, 4)
    return t[..., 0] | (t[..., 1] << 2) | (t[..., 2] << 4) | (t[..., 3] << 6)


def unpack_types(packed: torch.Tensor, groups: int) -> torch.Tensor:
    """uint8 [..., ceil(G / 4)] -> type ids uint8 [..., G]."""
    t = torch.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], -1).reshape(*packed.shape[:-1], -1)
    return t[..., :groups]
