"""Bit allocation across experts: PMQ (MC#) and AlphaQ, both as one multiple-choice program
    minimise  sum_e importance_e * err_e(b_e)   s.t.  sum_e size_e * b_e <= avg_bits * sum_e size_e,
    b_e in widths,
solved exactly as a 0/1 integer program (one indicator per expert and width). PMQ takes its importance
from calibration (how often and how strongly each expert is routed to); AlphaQ from each expert's
heavy-tailed weight spectrum, without data."""
from __future__ import annotations

import numpy as np
import torch

WIDTHS = (2, 3, 4, 8)


def allocate(importance: np.ndarray, err: np.ndarray, sizes: np.ndarray, widths, avg_bits: float) -> np.ndarray:
    """err [experts, widths]: quantization error of each expert at each width. Returns one width per expert."""
    from scipy.optimize import Bounds, LinearConstraint, milp  # imported on use: scipy is heavy for `import zoo`

    widths = np.asarray(widths, dtype=float)
    n, w = err.shape
    if w != len(widths):
        raise ValueError(f"err has {w} columns for {len(widths)} widths")
    cost = (importance[:, None] * err).ravel()  # x[e * w + j] = 1: expert e takes widths[j]
    one_each = np.kron(np.eye(n), np.ones(w))
    bits = (sizes[:, None] * widths[None, :]).ravel()
    res = milp(c=cost, integrality=np.ones(n * w), bounds=Bounds(0, 1),
               constraints=[LinearConstraint(one_each, 1, 1),
                            LinearConstraint(bits[None, :], -np.inf, avg_bits * sizes.sum() + 1e-6)])
    if not res.success:
        raise RuntimeError(f"bit allocation failed: {res.message}")
    return widths[np.round(res.x).reshape(n, w).argmax(1)].astype(int)


def pmq(significance: np.ndarray, err: np.ndarray, sizes: np.ndarray, widths, avg_bits: float) -> np.ndarray:
    """MC#'s PMQ: significance (routing frequency x routing weight, from calibration) times error."""
    return allocate(significance, err, sizes, widths, avg_bits)


def esd_alpha(w: torch.Tensor, min_tail: int = 8) -> float:
    """Power-law exponent of the eigenvalue spectrum of W W^T (heavy-tailed self-regularisation): the MLE
    (Hill) fit over the tail lambda >= xmin, with xmin chosen by the smallest Kolmogorov-Smirnov distance."""
    ev = torch.linalg.svdvals(w.double()).pow(2).sort().values.cpu().numpy()
    ev = ev[ev > ev.max() * 1e-12]
    best = (np.inf, 2.0)
    for i in range(max(1, len(ev) - min_tail)):
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


def alphaq(alphas: np.ndarray, err: np.ndarray, sizes: np.ndarray, widths, avg_bits: float) -> np.ndarray:
    """AlphaQ: heavier-tailed (smaller alpha, better-trained) experts weigh more in the error objective,
    importance_e = mean(alpha) / alpha_e, so under the budget they are the ones kept at higher widths."""
    return allocate(alphas.mean() / alphas, err, sizes, widths, avg_bits)
