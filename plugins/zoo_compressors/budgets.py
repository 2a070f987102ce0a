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
- "search": an evolutionary search over splits scored by the model's own loss on calibration tokens, as EvoESAP
  scores its candidates (each layer keeps its best n experts by the method's score, so only the counts are searched):
  a (mu + lambda) loop that moves experts between layers, started from the uniform, "global" and "error" splits, so
  it never ends worse than they do on the calibration tokens. It runs the whole model for every candidate, so it
  needs the model in memory.
"""
from __future__ import annotations

import torch

ALLOCATIONS = ("uniform", "global", "error", "search")


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

    def output(moe):  # a block that returns more beside its output (GPT-OSS's scores, Zaya's router state)
        out = moe(x)
        return (out[0] if isinstance(out, tuple) else out).double()

    full = output(block)
    norm = full.pow(2).sum().clamp(min=1e-30)
    curve = {}
    for n in range(floor, len(order) + 1):
        out = full if n == len(order) else output(keep_experts(block, order[:n]))
        curve[n] = float((out - full).pow(2).sum() / norm)
    return curve


def search_counts(loss, starts: list[dict[int, int]], floors: dict[int, int], caps: dict[int, int],
                  generations: int = 12, population: int = 8, seed: int = 0, progress=None):
    """The split of least ``loss(counts)`` found by a (mu + lambda) evolutionary search over splits with the total of
    ``starts`` (each a split: {layer: count}, floors[i] <= count <= caps[i]). Each generation keeps the best
    ``population`` splits seen and adds as many children, each its parent with one or two experts moved from one
    layer to another. Returns (best split, its loss, {split: loss} of every candidate scored)."""
    import random

    rng = random.Random(seed)
    layers = sorted(floors)
    scored: dict[tuple, float] = {}

    def score(counts: tuple) -> float:
        if counts not in scored:
            scored[counts] = float(loss(dict(zip(layers, counts))))
            if progress is not None:
                progress.update(1)
        return scored[counts]

    def child(parent: tuple) -> tuple | None:
        counts = list(parent)
        for _ in range(rng.choice((1, 2))):
            give = [k for k, i in enumerate(layers) if counts[k] > floors[i]]
            take = [k for k, i in enumerate(layers) if counts[k] < caps[i]]
            if not give or not take:
                return None
            a, b = rng.choice(give), rng.choice(take)
            if a != b:
                counts[a], counts[b] = counts[a] - 1, counts[b] + 1
        return tuple(counts)

    parents = list(dict.fromkeys(tuple(s[i] for i in layers) for s in starts))
    for p in parents:
        score(p)
    for _ in range(generations):
        children = [c for c in (child(rng.choice(parents)) for _ in range(population)) if c is not None]
        pool = list(dict.fromkeys(parents + children))
        parents = sorted(pool, key=score)[:population]
    best = min(scored, key=scored.get)
    return dict(zip(layers, best)), scored[best], scored


SEARCH_TOKENS = 4096  # calibration tokens each candidate split is scored on


def search_loss(model, batches, orders: dict[int, list[int]], tokens: int = SEARCH_TOKENS):
    """``loss(counts)``: the model's mean next-token loss on the first ``tokens`` calibration tokens when MoE layer i
    keeps its experts ``orders[i][:counts[i]]`` (swapped in for the call, the model's own blocks put back after)."""
    from zoo.moe.layout import decoder_layers, get_block, put_block
    from zoo.moe.surgery import keep_experts

    ids, used = [], 0
    for b in batches:
        b = b["input_ids"] if isinstance(b, dict) else b
        if used >= tokens:
            break
        ids.append(b[: max(1, (tokens - used) // b.shape[1])])
        used += ids[-1].numel()
    layers = decoder_layers(model)
    own = {i: get_block(layers[i]) for i in orders}

    @torch.no_grad()
    def loss(counts: dict[int, int]) -> float:
        try:
            for i, n in counts.items():
                put_block(layers[i], own[i] if n == len(orders[i]) else keep_experts(own[i], orders[i][:n]))
            total = sum(float(model(input_ids=b, labels=b, use_cache=False).loss) * (b.shape[1] - 1) * len(b)
                        for b in ids)
            return total / sum((b.shape[1] - 1) * len(b) for b in ids)
        finally:
            for i, block in own.items():
                put_block(layers[i], block)

    return loss


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


__all__ = ["ALLOCATIONS", "check_allocation", "error_counts", "error_curve", "floor_of", "global_counts", "search_counts", "search_loss",
           "spread"]
