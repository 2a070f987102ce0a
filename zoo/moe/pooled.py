"""One model's experts served from a pool of experts that several models share (``zoo.consolidate``).

Fused expert tensors ``[E, ...]`` cannot share single experts across models (one tensor is one storage), so a
consolidated model's block holds a ``PooledExperts``: the pool (a plain dense experts module over every distinct
expert of that layer, the *same module object* in every model) and this model's ``slots [E]`` (its expert e is
pool row ``slots[e]``). The block and its expert map are untouched: the router still picks among E experts, and
the pool runs its own dispatch (sorted prefill, gathered decode, the zoo's kernel) on the remapped indices.

Saved, it is an ordinary checkpoint of the pool's kind with this model's E experts (its rows gathered), so the
folder loads alone through ``AutoModelForCausalLM`` after ``import zoo``.
"""
from __future__ import annotations

import torch

from zoo.moe.experts import Experts
from zoo.moe.routing import Routing

SHARED_HINT = ("these experts are shared with other consolidated models; zoo.editing.consolidation.unshare(model) gives "
               "the model its own experts first")


class PooledExperts(Experts):
    """``PooledExperts(pool, slots)``: expert e is ``pool``'s expert ``slots[e]``."""

    summary = "A consolidated model's experts: rows of a pool shared with other fine-tunes (zoo.consolidate)."

    def __init__(self, pool: Experts | None = None, slots=None, **options):
        if pool is None or options:  # surgery rebuilds experts as type(experts)(**options): not on shared rows
            raise ValueError(SHARED_HINT)
        super().__init__()
        slots = torch.as_tensor(slots, dtype=torch.long, device="cpu")
        if slots.dim() != 1 or len(slots) < 1 or int(slots.min()) < 0 or int(slots.max()) >= pool.num_experts:
            raise ValueError(f"slots must name rows of the pool's {pool.num_experts} experts, got {slots.tolist()}")
        self.pool = pool
        self.num_experts = len(slots)
        self.name = pool.name  # what the layout records: the pool's kind, with this model's E experts
        for attr in ("hidden_size", "intermediate_size", "activation"):
            if hasattr(pool, attr):
                setattr(self, attr, getattr(pool, attr))
        device = next(iter(pool.parameters())).device
        # router index E marks an empty slot: it becomes the pool's own empty index; ``slots`` is a view of it
        self.register_buffer("table", torch.cat([slots, slots.new_tensor([pool.num_experts])]).to(device),
                             persistent=False)
        self._register_state_dict_hook(_own_rows)

    @property
    def slots(self) -> torch.Tensor:
        """``[E]``: the pool row of each of this model's experts."""
        return self.table[:-1]

    def options(self) -> dict:
        return {**self.pool.options(), "num_experts": self.num_experts}

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.pool.expert(int(self.slots[e]), x)

    def reference(self, hidden: torch.Tensor, routing) -> torch.Tensor:
        """Every (token, slot) pair through its expert alone, weighted and summed."""
        out = hidden.new_zeros(hidden.shape)
        for t in range(hidden.shape[0]):
            for slot, e in enumerate(routing.indices[t].tolist()):
                if e < self.num_experts:
                    out[t] += routing.weights[t, slot].to(hidden.dtype) * self.expert(e, hidden[t:t + 1])[0]
        return out

    def forward(self, hidden: torch.Tensor, routing) -> torch.Tensor:
        pool_dtype = next(iter(self.pool.parameters())).dtype
        if pool_dtype != hidden.dtype and not torch.is_autocast_enabled(hidden.device.type):  # (no host sync)
            raise ValueError(f"this consolidated model runs in {hidden.dtype} but its shared experts are {pool_dtype}: "
                             "the pool is one module shared by every consolidated model, and one of them was moved to "
                             "another dtype; move them all together, or give a model its own experts first "
                             "(zoo.editing.consolidation.unshare(model))")
        indices = self.table[routing.indices]  # a gather: no host sync on the decode path
        return self.pool(hidden, Routing(routing.weights, indices, routing.logits))


def _own_rows(module: PooledExperts, state_dict, prefix, local_metadata):
    """The state of an ordinary experts module with this model's E experts: the pool's tensors, rows gathered."""
    for key in [k for k in state_dict if k.startswith(prefix + "pool.")]:
        tensor = state_dict.pop(key)
        state_dict[prefix + key[len(prefix) + len("pool."):]] = tensor.detach().index_select(
            0, module.slots.to(tensor.device))
    return state_dict


def own_experts(experts: PooledExperts) -> Experts:
    """A plain experts module of the pool's kind holding copies of this model's E experts."""
    opts = experts.options()
    with torch.device("meta"):
        plain = type(experts.pool)(**opts)
    plain.load_state_dict(experts.state_dict(), assign=True)
    return plain
