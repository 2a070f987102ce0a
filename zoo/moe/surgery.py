"""Structural edits of a SparseMoE: keep a subset of experts, or replace experts by merged ones.

Pruning keeps one router row per remaining expert, so routing among the survivors is unchanged. Merging either
keeps every router row and serves each original expert by its group's merged expert (an expert map, HC-SMoE's
code), or cuts the router to one row per group (``router_rows``). A router's rows that score shared experts
(``Router.shared_rows``: Inkling's) are no experts: every edit keeps them, after the experts' rows. A router whose
gate has no row per expert (``product-key``) keeps experts by its own ``keep_rows(rows)``, and cannot be cut.
"""
from __future__ import annotations

import torch

from zoo.moe.block import SparseMoE


def place_like(router, old):
    """Put a new router where the old one lived: same device, parameters in the old dtype (that of the old
    parameter of the same name where there is one: Inkling keeps its ``global_scale`` in fp32; buffers such as
    DeepSeek's selection bias keep their own dtype)."""
    router.to(old.weight.device)
    dtypes = {name: p.dtype for name, p in old.named_parameters()}
    for name, p in router.named_parameters():
        p.data = p.data.to(dtypes.get(name, old.weight.dtype))
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
                state[name] = param.index_select(0, rows.to(param.device))
            else:
                mix = weights.to(param.device, torch.float32)
                state[name] = torch.einsum("ne,e...->n...", mix, param.float()).to(param.dtype)
    new.load_state_dict(state, assign=True)
    return new


def _router_rows(old, rows: torch.Tensor):
    """A router like ``old`` with only its rows ``rows`` (all of them: a copy); rows scoring shared experts stay."""
    if getattr(old, "keep_rows", None) is not None:  # a gate with no row per expert (product-key): its own way
        return place_like(old.keep_rows(rows), old)
    router = router_like(old, len(rows))
    routed, shared = _split_shared_rows(old)
    state = {k: (v.index_select(0, rows.to(v.device)) if v.dim() and v.shape[0] == old.num_experts else v)
             for k, v in routed.items()}
    router.load_state_dict(_with_shared_rows(state, shared))
    return place_like(router, old)


def _split_shared_rows(router) -> tuple[dict, dict]:
    """(the router's state with only its experts' rows, the rows after them that score shared experts, by name)."""
    state, E, S = router.state_dict(), router.num_experts, router.shared_rows
    if not S:
        return state, {}
    scoring = {k for k, v in state.items() if v.dim() and v.shape[0] == E + S}
    return {k: v[:E] if k in scoring else v for k, v in state.items()}, {k: state[k][E:] for k in scoring}


def _with_shared_rows(state: dict, shared: dict) -> dict:
    return {k: torch.cat([v, shared[k].to(v.device, v.dtype)]) if k in shared else v for k, v in state.items()}


@torch.no_grad()
def keep_experts(moe: SparseMoE, keep) -> SparseMoE:
    """A SparseMoE with only the experts ``keep`` (in that order); their router rows come along (behind an expert
    map: the rows of every original expert a kept merged expert serves). Identity experts are not among the experts
    ``keep`` names: all of them stay, their router rows after the kept experts'."""
    keep = torch.as_tensor(sorted(int(i) for i in keep), dtype=torch.long)
    if len(keep) < 1 or len(set(keep.tolist())) != len(keep):
        raise ValueError("keep must name at least one expert, without repeats")
    if int(keep[0]) < 0 or int(keep[-1]) >= moe.num_experts:
        raise ValueError(f"keep must name experts in [0, {moe.num_experts}), got {keep.tolist()}")
    if moe.expert_map is None:
        identity = torch.arange(moe.num_experts, moe.num_experts + moe.identity_experts)
        return moe.with_parts(_router_rows(moe.router, torch.cat([keep, identity])), _slice_experts(moe.experts, keep))
    new_id = {int(m): j for j, m in enumerate(keep)}
    rows = [e for e, m in enumerate(moe.expert_map) if m in new_id]
    new_map = [new_id[moe.expert_map[e]] for e in rows]
    return moe.with_parts(_router_rows(moe.router, torch.tensor(rows)), _slice_experts(moe.experts, keep),
                          expert_map=None if new_map == list(range(len(keep))) else new_map)


def merge_map(moe: SparseMoE, groups: list[list[int]]) -> list[int]:
    """Original expert (router row) -> group, for ``groups`` of the block's experts (composed with the block's
    own map when it already has one)."""
    group_of = {m: g for g, members in enumerate(groups) for m in members}
    if sorted(group_of) != list(range(moe.num_experts)) or sum(map(len, groups)) != moe.num_experts:
        raise ValueError(f"groups must split the {moe.num_experts} experts, each in exactly one group")
    served = moe.expert_map if moe.expert_map is not None else range(moe.num_experts)
    return [group_of[m] for m in served]


@torch.no_grad()
def merge_experts(moe: SparseMoE, groups: list[list[int]], weights: list[list[float]],
                  router_rows=None, experts=None) -> SparseMoE:
    """One expert per group: the weighted average of its members' weights (or the ``experts`` given, one per
    group). ``router_rows`` None (HC-SMoE's code): the router keeps all its rows and an expert map sends each
    original expert to its group's merged expert, so routing picks exactly as before. ``router_rows``, a function
    ``(old router state, mix [N, E]) -> state with N rows``: the router is cut to one row per group."""
    if moe.identity_experts:
        raise ValueError(f"this block has {moe.identity_experts} identity experts beside its {moe.num_experts} "
                         "experts; merging does not support them (prune instead: pruning keeps them)")
    expert_map = merge_map(moe, groups)
    mix = torch.zeros(len(groups), moe.num_experts)
    for g, (members, w) in enumerate(zip(groups, weights)):
        total = float(sum(w))
        for m, x in zip(members, w):
            mix[g, m] = x / total
    merged = _slice_experts(moe.experts, None, mix) if experts is None else experts
    if router_rows is None:
        return moe.with_parts(_router_rows(moe.router, torch.arange(moe.router.num_experts)), merged,
                              expert_map=None if expert_map == list(range(moe.router.num_experts)) else expert_map)
    if getattr(moe.router, "keep_rows", None) is not None:
        raise ValueError(f"router {moe.router.name!r} has no row per expert to cut into one per group; merge behind "
                         "an expert map instead (router_rows=None)")
    if moe.expert_map is not None:
        raise ValueError("a cut router needs one router row per expert, but this block already serves its router's "
                         f"{moe.router.num_experts} rows with {moe.num_experts} merged experts (an expert map)")
    router = router_like(moe.router, len(groups))
    routed, shared = _split_shared_rows(moe.router)  # the function sees the experts' rows alone
    router.load_state_dict(_with_shared_rows(router_rows(routed, mix), shared))
    place_like(router, moe.router)
    return moe.with_parts(router, merged)
