"""Bit allocation across experts: uniform, PMQ (MC#: an integer linear program trading expert
significance against quantization error under a bit budget) and AlphaQ (calibration-free, from each
expert's heavy-tailed weight spectrum)."""
from __future__ import annotations

import numpy as np
import torch
from scipy.optimize import Bounds, LinearConstraint, milp

LOW, HIGH = 4, 8


def n_high(total: int, avg_bits: float) -> int:
    """How many of ``total`` equal-size experts can take HIGH bits with the rest at LOW, within avg_bits."""
    return int(np.floor(total * (avg_bits - LOW) / (HIGH - LOW) + 1e-9))


def pmq(significance: np.ndarray, err_low: np.ndarray, err_high: np.ndarray, sizes: np.ndarray,
        avg_bits: float) -> np.ndarray:
    """MC#'s PMQ: choose one width per expert to minimise sum_e significance_e * err_e(width) subject to
    sum_e size_e * width_e <= avg_bits * sum_e size_e. Solved exactly as a 0/1 program (x_e = 1: HIGH)."""
    gain = significance * (err_low - err_high)  # objective drop when expert e goes from LOW to HIGH
    budget = (avg_bits - LOW) * sizes.sum()
    extra = (HIGH - LOW) * sizes
    res = milp(c=-gain, constraints=LinearConstraint(extra[None, :], -np.inf, budget + 1e-6),
               integrality=np.ones_like(gain), bounds=Bounds(0, 1))
    if not res.success:
        raise RuntimeError(f"PMQ bit allocation failed: {res.message}")
    return np.where(np.round(res.x) > 0, HIGH, LOW)


def esd_alpha(w: torch.Tensor, min_tail: int = 8) -> float:
    """Power-law exponent of the eigenvalue spectrum of W W^T (heavy-tailed self-regularisation): the MLE
    (Hill) fit over the tail lambda >= xmin, with xmin chosen by the smallest Kolmogorov-Smirnov distance."""
    ev = torch.linalg.svdvals(w.double()).pow(2).sort().values.numpy()
    ev = ev[ev > ev.max() * 1e-12]
    best = (np.inf, 2.0)
    for i in range(0, max(1, len(ev) - min_tail)):
        tail = ev[i:]
        xmin = tail[0]
        alpha = 1 + len(tail) / np.log(tail / xmin).sum() if np.log(tail / xmin).sum() > 0 else np.inf
        if not np.isfinite(alpha):
            continue
        cdf_emp = np.arange(1, len(tail) + 1) / len(tail)
        cdf_fit = 1 - (tail / xmin) ** (1 - alpha)
        ks = np.abs(cdf_emp - cdf_fit).max()
        if ks < best[0]:
            best = (ks, alpha)
    return float(best[1])


def alphaq(alphas: np.ndarray, sizes: np.ndarray, avg_bits: float) -> np.ndarray:
    """AlphaQ: heavier-tailed (smaller alpha, better trained) experts get HIGH bits first, within budget."""
    bits = np.full(len(alphas), LOW)
    budget = (avg_bits - LOW) * sizes.sum()
    for e in np.argsort(alphas, kind="stable"):
        cost = (HIGH - LOW) * sizes[e]
        if cost <= budget + 1e-6:
            bits[e], budget = HIGH, budget - cost
    return bits
