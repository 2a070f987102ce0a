"""The router logits of one forward call, read off the MoE blocks' routers themselves.

transformers installs its output recorders once per model, on the routers present at the first call that asks for
router logits; a block replaced afterwards (a prune, a merge) runs a router without one, and its logits go missing.
Here every call hooks the routers the model holds at that moment, so the record always covers the current blocks,
each logit matrix paired with the router that produced it (its top-k)."""
from __future__ import annotations

import contextlib
import functools
from contextvars import ContextVar

import torch

_active: ContextVar[list | None] = ContextVar("zoo_router_logits", default=None)


def _record(router, args, output) -> None:
    seen = _active.get()
    logits = getattr(output, "logits", None)
    if seen is not None and logits is not None:
        seen.append((router, logits))


@contextlib.contextmanager
def recorded_router_logits(model):
    """Yields a list that fills, during the block, with ``(router, logits [T, E])`` in the order the routers ran
    (a router run twice appears twice). Thread- and context-safe: only calls inside the block are recorded."""
    from zoo.moe.block import unwrapped
    from zoo.moe.layout import moe_layers

    for _, moe in moe_layers(model):
        router = unwrapped(moe.router)
        if not getattr(router, "_zoo_logits_hooked", False):  # hooked once per module; copies keep the hook
            router.register_forward_hook(_record)
            router._zoo_logits_hooked = True
    _hook_extra_routers(model)
    seen: list = []
    token = _active.set(seen)
    try:
        yield seen
    finally:
        _active.reset(token)


def recording() -> list | None:
    """The list ``recorded_router_logits`` is filling in this context, or None outside one."""
    return _active.get()


def merge_part_records(seen: list, start: int, part_rows: list, tokens: int) -> None:
    """Replace the records parts of one layer made since ``start`` (one per part, each over its own rows
    ``part_rows[p]`` of the layer's ``tokens``) by one ``[tokens, E]`` matrix, rows in token order, as a family
    whose layer routes tokens by modality reports its logits (ERNIE-4.5-VL); paired with the first part's router.
    Parts of different expert counts (a non-uniform prune) are padded to the widest with the dtype's lowest value:
    probability 0 and never picked, so the padded columns add no load."""
    entries = seen[start:]
    width = max(lg.shape[-1] for _, lg in entries)
    first = entries[0][1]
    merged = first.new_zeros(tokens, width)
    for (_, lg), rows in zip(entries, part_rows):
        if lg.shape[-1] < width:
            lg = torch.nn.functional.pad(lg, (0, width - lg.shape[-1]), value=torch.finfo(lg.dtype).min)
        merged = merged.index_copy(0, rows.to(merged.device), lg.to(merged.dtype))
    del seen[start:]
    seen.append((entries[0][0], merged))


def _hook_extra_routers(model) -> None:
    """Native routers a family's balance loss also reads (JetMoE's attention gatings, ``Family.extra_routers``):
    recorded in call order with the zoo's, their logits at the index the family names in their output."""
    extra = getattr(getattr(type(model), "zoo_family", None), "extra_routers", None)
    if extra is None:
        return
    for cls, index in extra():
        for module in model.modules():
            if isinstance(module, cls) and not getattr(module, "_zoo_logits_hooked", False):
                module.register_forward_hook(functools.partial(_record_native, index))
                module._zoo_logits_hooked = True


def _record_native(index, module, args, output) -> None:
    seen = _active.get()
    if seen is not None:
        seen.append((module, output[index]))
