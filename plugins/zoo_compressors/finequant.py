"""FineQuant's adaptive granularity (Kim et al., 2023, arXiv:2308.09723): the group size of each matrix is chosen
from its weights alone, by the quantization error each size causes. Coarse groups are cheap (one scale/zero per
group) but an outlier widens its whole group's range; finer groups isolate it. The rule: start at the coarsest
group the int4 pack takes and halve while the matrix's error there exceeds ``1 + alpha`` times its error at the
finest group, so a matrix keeps coarse groups unless they cost it clearly more than fine ones."""
from __future__ import annotations

import torch

from zoo.moe.quantized import dequantize, quantize_grouped

GROUP_SIZES = (256, 128, 64, 32)  # what torch's int4 pack takes, coarsest first


def candidates(k: int) -> list[int]:
    """The group sizes of the int4 pack that divide an input width ``k``, coarsest first."""
    return [g for g in GROUP_SIZES if k % g == 0]


@torch.no_grad()
def grouped_error(weights, group_size: int) -> float:
    """sum_e ||W_e - Q(W_e)||^2 / sum_e ||W_e||^2 over ``(weight, bits)`` pairs quantized at one group size."""
    err = norm = 0.0
    for w, bits in weights:
        _, scale_zero, codes = quantize_grouped(w, group_size, bits)
        deq = dequantize(bits, None, scale_zero, w.shape, group_size, codes=codes)
        err += float((w.float() - deq).pow(2).sum())
        norm += float(w.float().pow(2).sum())
    return err / max(norm, 1e-30)


def adaptive_group(weights, k: int, alpha: float) -> tuple[int, dict]:
    """(group size, {group size: error}) for the matrices ``weights`` (``(W [N, k], bits)`` pairs that share one
    group size): the coarsest candidate whose error is at most ``(1 + alpha)`` times the finest one's."""
    sizes = candidates(k)
    if not sizes:
        raise ValueError(f"no group size of {sorted(GROUP_SIZES)} divides {k}")
    errors = {sizes[-1]: grouped_error(weights, sizes[-1])}
    for g in sizes:  # coarsest first: halve while the error bound is violated
        errors.setdefault(g, grouped_error(weights, g))
        if errors[g] <= (1 + alpha) * errors[sizes[-1]]:
            return g, errors
    return sizes[-1], errors
