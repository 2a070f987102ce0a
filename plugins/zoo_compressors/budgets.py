"""Per-layer expert budgets: how many experts each MoE layer keeps when the total is fixed.

An expert-count compressor's ``num_experts`` is a count per layer; with ``allocation`` other than "uniform" it is the
average, and the total ``num_experts x layers`` is shared out across layers (never below a layer's ``floor``, the
router's top-k, nor above the experts it has):

- "global": every expert's share of its layer's score (the method's own score: routed counts, REAP saliency), ranked
  across all layers; the best shares are kept. A layer whose experts are all alike in use keeps fewer than one
  whose use is concentrated on a few, which loses more from each pruned expert.
- "error": each layer's output error when it keeps its best n experts (by the method's score), for every n, on the
  calibration tokens; the split of the total that minimises the summed relative error, found exactly by dynamic
  programming over layers (the objective separates by layer, so no search is needed: EvoESAP searches with an
  evolutionary loop because its objective, the model's loss, does not separate; this one ignores how a layer's
  error changes the next layer's input).
"""
from __future__ import annotations

import torch

ALLOCATIONS = ("uniform", "global", "error")


def global_counts(scores: dict[int, torch.Tensor], total: int, floors: dict[int, int]) -> dict[int, int]:
    """Experts per layer: each layer's ``floors[i]`` best, then the best remaining shares of all layers up to
    ``total``. ``scores[i]``: one non-negative score per expert of layer i (higher = keep)."""
    counts = {i: floors[i] for i in scores}
    candidates = []
    for i, s in scores.items():
        s = s.double().clamp(min=0)
        share = s / s.sum() if s.sum() > 0 else torch.full_like(s, 1.0 / len(s))
        ranked = share.sort(descending=True, stable=True).values.tolist()
        candidates += [(-v, i, r) for r, v in enumerate(ranked) if r >= floors[i]]
    # ties: the earlier layer, then its better expert, so the split is deterministic
    for _, i, _ in sorted(candidates)[:total - sum(counts.values())]:
        counts[i] += 1
    return counts


def error_counts(curves: dict[int, dict[int, float]], total: int) -> dict[int, int]:
    """The per-layer counts with sum ``total`` that minimise sum_i curves[i][n_i] (``curves[i]``: {count: error} over
    the counts layer i may keep). Exact: dynamic programming over layers."""
    layers = sorted(curves)
    best = {0: (0.0, [])}  # experts used so far -> (least error, counts chosen)
    for i in layers:
        step = {}
        for used, (err, chosen) in best.items():
            for n, e in curves[i].items():
                if used + n <= total and (used + n not in step or err + e < step[used + n][0]):
                    step[used + n] = (err + e, chosen + [n])
        best = step
    if total not in best:
        raise ValueError(f"no split of {total} experts fits the layers' limits")
    return dict(zip(layers, best[total][1]))


@torch.no_grad()
def error_curve(block, x: torch.Tensor, order: list[int], floor: int) -> dict[int, float]:
    """{n: relative squared error of the block's output on ``x [T, H]`` when it keeps its experts ``order[:n]``}
    for n from ``floor`` to all of them (the router renormalises over the kept ones, as the pruned block will)."""
    from zoo.moe.surgery import keep_experts

    full = block(x).double()
    norm = full.pow(2).sum().clamp(min=1e-30)
    curve = {}
    for n in range(floor, len(order) + 1):
        out = full if n == len(order) else keep_experts(block, order[:n])(x).double()
        curve[n] = float((out - full).pow(2).sum() / norm)
    return curve


def check_allocation(allocation) -> None:
    if allocation not in ALLOCATIONS:
        import difflib

        close = difflib.get_close_matches(str(allocation), ALLOCATIONS, n=1)
        raise ValueError(f"allocation must be one of {', '.join(ALLOCATIONS)}, got {allocation!r}"
                         + (f"; did you mean {close[0]!r}?" if close else ""))


def floor_of(block, num_experts: int) -> int:
    """The fewest experts a layer may keep: its router's top-k (no fewer than it routes to), at most the average."""
    return max(1, min(block.top_k, num_experts, block.num_experts))


def spread(counts: dict[int, int]) -> str:
    """"min-max (per layer: ...)" for results and cards."""
    values = [counts[i] for i in sorted(counts)]
    return f"{min(values)}-{max(values)} per layer ({'/'.join(map(str, values))})" if values else "-"


__all__ = ["ALLOCATIONS", "check_allocation", "error_counts", "error_curve", "floor_of", "global_counts", "spread"]
