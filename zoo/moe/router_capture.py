"""The router logits of one forward call, read off the MoE blocks' routers themselves.

transformers installs its output recorders once per model, on the routers present at the first call that asks for
router logits; a block replaced afterwards (a prune, a merge) runs a router without one, and its logits go missing.
Here every call hooks the routers the model holds at that moment, so the record always covers the current blocks,
each logit matrix paired with the router that produced it (its top-k)."""
from __future__ import annotations

import contextlib
from contextvars import ContextVar

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
    seen: list = []
    token = _active.set(seen)
    try:
        yield seen
    finally:
        _active.reset(token)
