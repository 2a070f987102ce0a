"""Structural edits of a SparseMoE: keep a subset of experts, or replace experts by merged ones.

The router keeps one row per remaining expert, so routing among the survivors is unchanged.
"""
from __future__ import annotations

import torch

from zoo.moe.block import SparseMoE


def place_like(router, old):
    """Put a new router where the old one lived: same device, parameters in the old dtype (buffers such as
    DeepSeek's selection bias keep their own dtype)."""
    router.to(old.weight.device)
    for p in router.parameters():
        p.data = p.data.to(old.weight.dtype)
    return router


def router_like(old, num_experts: int, top_k: int | None = None):
    """A router of the old one's class and options for ``num_experts`` experts. Group-limited selection
    (DeepSeek-V3) is turned off when the expert set changes: its groups were the original experts'."""
    opts = dict(old.options)
    if "n_group" in opts and num_experts != old.num_experts:
        opts.update(n_group=1, topk_group=1)
    k = min(top_k or old.top_k, num_experts)
    return type(old)(old.hidden_size, num_experts, k, **opts)


def _slice_experts(experts, rows: torch.Tensor, weights: torch.Tensor | None = None):
    """New experts; each is a (weighted) combination of old ones: ``rows`` [N] or ``weights`` [N, E]."""
    opts = experts.options()
    opts["num_experts"] = len(rows) if weights is None else weights.shape[0]
    with torch.device("meta"):  # no storage to initialise and then overwrite: the new tensors are assigned
        new = type(experts)(**opts)
    state = {}
    with torch.no_grad():
        for name, param in experts.named_parameters():
            if weights is None:
                state[name] = param.index_select(0, rows)
            else:
                state[name] = torch.einsum("ne,e...->n...", weights.to(torch.float32), param.float()).to(param.dtype)
    new.load_state_dict(state, assign=True)
    return new


@torch.no_grad()
def keep_experts(moe: SparseMoE, keep) -> SparseMoE:
    """A SparseMoE with only the experts ``keep`` (in that order); their router rows come along."""
    keep = torch.as_tensor(sorted(int(i) for i in keep), dtype=torch.long)
    if len(keep) < 1 or len(set(keep.tolist())) != len(keep):
        raise ValueError("keep must name at least one expert, without repeats")
    router = router_like(moe.router, len(keep))
    state = {k: (v.index_select(0, keep) if v.dim() and v.shape[0] == moe.num_experts else v)
             for k, v in moe.router.state_dict().items()}
    router.load_state_dict(state)
    place_like(router, moe.router)
    return moe.with_parts(router, _slice_experts(moe.experts, keep))


@torch.no_grad()
def merge_experts(moe: SparseMoE, groups: list[list[int]], weights: list[list[float]], router_rows) -> SparseMoE:
    """One expert per group: the weighted average of its members' weights; ``router_rows`` [N, ...] gives
    the router state for the merged experts (a function of the old state, chosen by the method)."""
    mix = torch.zeros(len(groups), moe.num_experts)
    for g, (members, w) in enumerate(zip(groups, weights)):
        total = float(sum(w))
        for m, x in zip(members, w):
            mix[g, m] = x / total
    router = router_like(moe.router, len(groups))
    router.load_state_dict(router_rows(moe.router.state_dict(), mix))
    place_like(router, moe.router)
    return moe.with_parts(router, _slice_experts(moe.experts, None, mix))
