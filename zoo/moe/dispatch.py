"""Index bookkeeping for expert dispatch (MegaBlocks style): computed without grad, apart from compute."""
from __future__ import annotations

from typing import NamedTuple

import torch


class DispatchPlan(NamedTuple):
    order: torch.Tensor  # [n] positions into the flattened [T*k] routing, grouped by expert
    token: torch.Tensor  # [n] token index of each sorted slot
    counts: list[int]  # tokens per expert (length E); slots of the empty marker E are dropped


@torch.no_grad()
def sort_by_expert(indices: torch.Tensor, num_experts: int) -> DispatchPlan:
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts].tolist()
    n = sum(counts)
    order = order[:n]  # the empty marker (== E) sorts last
    return DispatchPlan(order, order // indices.shape[1], counts)


def combine(y: torch.Tensor, weights: torch.Tensor, plan: DispatchPlan, tokens: int) -> torch.Tensor:
    """Scale each sorted expert output by its routing weight and add it back to its token."""
    w = weights.reshape(-1).index_select(0, plan.order)
    y = y * w[:, None].to(y.dtype)
    out = torch.zeros(tokens, y.shape[-1], dtype=y.dtype, device=y.device)
    return out.index_add_(0, plan.token, y)


def run_sorted(hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, num_experts: int,
               expert) -> torch.Tensor:
    """The sorted dispatch: each expert with tokens runs once, ``expert(e, x [n, H]) -> [n, H]``, on its
    contiguous slice of the (token, slot) pairs; outputs are weighted and added back per token."""
    plan = sort_by_expert(indices, num_experts)
    x = hidden.index_select(0, plan.token)
    outs, start = [], 0
    for e, n in enumerate(plan.counts):  # host-side counts: eager code, or inside an op opaque to the compiler
        if n:
            outs.append(expert(e, x[start:start + n]))
        start += n
    y = torch.cat(outs) if outs else x[:0]
    return combine(y, weights, plan, hidden.shape[0]).to(hidden.dtype)


def run_each(hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, num_experts: int,
             expert) -> torch.Tensor:
    """``run_sorted`` for a few tokens (decode), planned on the host with fewer, smaller operations. Each
    expert runs once on its rows, and outputs are weighted and added in ``run_sorted``'s order, so both
    give the same numbers."""
    k, w = indices.shape[1], weights.reshape(-1)
    slots: dict[int, list[int]] = {}
    for p, e in enumerate(indices.reshape(-1).tolist()):
        if e < num_experts:
            slots.setdefault(e, []).append(p)
    out = torch.zeros_like(hidden)
    for e in sorted(slots):
        if len(slots[e]) == 1:  # the common decode case: slices, no index tensors
            p = slots[e][0]
            y = expert(e, hidden[p // k: p // k + 1])
            out[p // k: p // k + 1] += y * w[p: p + 1, None].to(y.dtype)
            continue
        rows = [p // k for p in slots[e]]
        y = expert(e, hidden[rows])
        out.index_add_(0, torch.tensor(rows, device=out.device), y * w[slots[e]][:, None].to(y.dtype))
    return out


@torch.no_grad()
def gather_rows(indices: torch.Tensor, num_experts: int):
    """Flattened expert ids safe to index with, and a 0/1 mask of real (non-empty) slots."""
    flat = indices.reshape(-1)
    valid = flat < num_experts
    return flat.clamp(max=num_experts - 1), valid
