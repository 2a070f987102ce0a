"""The routing context: what a router may know about the tokens besides their hidden states.

A router class that sets ``uses_context = True`` is called as ``router(hidden [T, H], context)``, the same way
in every family; other routers are called as ``router(hidden)``. ``context`` is the ``RoutingContext`` of the
model call the block runs in, or None when the block runs outside one (a block called by hand, without
``with routing_context(...)``): a router that cannot route without it says so.

Who sets it: ``attach(model)`` (run by ``zoo.apply`` and by every zoo model's load when one of its routers uses
the context) wraps the model's forward so that each call publishes the context of its inputs; a model that
knows more (the multimodal ``zoo_mm`` model knows each token's modality and the prompt that conditions its
visual experts) sets its own with ``routing_context``. Models without a context router pay nothing.
"""
from __future__ import annotations

import dataclasses
import inspect
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch

TEXT, VISION, AUDIO = 0, 1, 2  # modality tags


@dataclass(frozen=True)
class RoutingContext:
    """Per-token facts of one model call. ``[B, S]`` fields line up with the block's hidden rows: row ``t`` of
    ``hidden [T, H]`` is entry ``t`` of the flattened field (``T = B * S``); ``rows(name, T)`` reads one so."""

    input_ids: torch.Tensor | None = None  # [B, S] token ids; -1 for a token that has none (an image patch)
    positions: torch.Tensor | None = None  # [B, S] each token's position in its sequence (the KV cache counted)
    attention_mask: torch.Tensor | None = None  # [B, S] 1 for a real token, 0 for padding
    modality: torch.Tensor | None = None  # [B, S] TEXT, VISION or AUDIO
    prompt_embeds: torch.Tensor | None = None  # [B, L, C] text embeddings that condition the routing (Parrot)
    prompt_mask: torch.Tensor | None = None  # [B, L] 1 for a real prompt token
    # [T, R] the router state each token's router reads from the previous MoE layer's (Zaya's ``zaya-mlp``): set by
    # the layer-at-a-time engine for the block it works on (in a model's forward the block is handed it instead)
    router_state: torch.Tensor | None = None

    def rows(self, name: str, tokens: int) -> torch.Tensor:
        """Field ``name`` as ``[T]``, one entry per hidden row; a clear error if absent or not aligned."""
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"the routing context of this call has no {name}")
        flat = value.reshape(-1)
        if flat.numel() != tokens:
            raise ValueError(f"routing context {name} has {flat.numel()} entries for {tokens} hidden rows: "
                             "this block does not run on the call's token sequence")
        return flat

    def part(self, start: int, stop: int) -> RoutingContext:
        """The context of hidden rows ``start:stop`` alone (a chunk of a block's tokens); the prompt fields, per
        sequence, stay whole."""
        rows = {name: getattr(self, name).reshape(-1)[start:stop][None]
                for name in ("input_ids", "positions", "attention_mask", "modality") if getattr(self, name) is not None}
        if self.router_state is not None:
            rows["router_state"] = self.router_state[start:stop]
        return dataclasses.replace(self, **rows)


def row_parts(x: torch.Tensor, chunk: int, offset: int = 0):
    """``(part, context)`` for consecutive chunks of ``chunk`` rows of ``x [T, H]`` (row 0 of ``x`` being row ``offset``
    of the current context's), each with the context of its own rows (None outside one): a router that reads
    per-token facts sees its chunk's."""
    ctx = current()
    for start in range(0, x.shape[0], chunk):
        part = x[start:start + chunk]
        yield part, None if ctx is None else ctx.part(offset + start, offset + start + part.shape[0])


_state = threading.local()


def current() -> RoutingContext | None:
    """The context of the innermost model call running in this thread, or None."""
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else None


@contextmanager
def routing_context(context: RoutingContext | None):
    """Publish ``context`` to the routers of every block that runs inside the ``with``."""
    stack = _state.__dict__.setdefault("stack", [])
    stack.append(context)
    try:
        yield context
    finally:
        stack.pop()


def uses_context(model) -> bool:
    from zoo.moe.routing import Router

    return any(isinstance(m, Router) and m.uses_context for m in model.modules())


def from_call(model, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
              inputs_embeds=None, cache=None, **_) -> RoutingContext:
    """The context of a transformers forward call: ids, positions (``position_ids``, else counted on from the
    cache), the attention mask's columns of these tokens, and modality tags from the config's media token ids."""
    tokens = input_ids if input_ids is not None else inputs_embeds[..., 0]
    batch, length = tokens.shape[:2]
    device = tokens.device
    cache = cache if cache is not None else past_key_values
    if position_ids is None:
        start = cache.get_seq_length() if cache is not None else 0
        position_ids = torch.arange(start, start + length, device=device).expand(batch, length)
    if attention_mask is not None and attention_mask.dim() == 2:
        attention_mask = attention_mask[:, -length:]  # generate passes the mask of the cached tokens too
    else:
        attention_mask = None
    modality = torch.full((batch, length), TEXT, device=device)
    if input_ids is not None:
        config = model.config
        for attr, tag in (("image_token_id", VISION), ("video_token_id", VISION), ("audio_token_id", AUDIO)):
            token = getattr(config, attr, None)
            if isinstance(token, int):
                modality = modality.masked_fill(input_ids == token, tag)
    return RoutingContext(input_ids=input_ids, positions=position_ids, attention_mask=attention_mask,
                          modality=modality)


def attach(model) -> None:
    """Make each forward call of ``model`` publish its context, if one of its routers uses it (once; a model
    whose routers no longer use it is detached)."""
    hooks = model.__dict__.get("_zoo_context_hooks")
    if uses_context(model) == bool(hooks):
        return
    if hooks:
        for hook in hooks:
            hook.remove()
        del model.__dict__["_zoo_context_hooks"]
        return
    signature = inspect.signature(type(model).forward)
    rest = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    def publish(module, args, kwargs):
        stack = _state.__dict__.setdefault("stack", [])
        stack.append(None)  # first, so the always-called withdraw pops this entry whatever happens next
        bound = signature.bind_partial(module, *args, **kwargs).arguments
        bound.update(bound.pop(rest, None) or {})
        stack[-1] = from_call(module, **{k: v for k, v in bound.items() if k != "self"})

    def withdraw(module, args, kwargs, output):
        _state.stack.pop()

    model.__dict__["_zoo_context_hooks"] = (
        model.register_forward_pre_hook(publish, with_kwargs=True),
        model.register_forward_hook(withdraw, with_kwargs=True, always_call=True))
