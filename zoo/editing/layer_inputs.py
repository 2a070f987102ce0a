"""What a calibration batch looks like at each decoder layer (``LayerInputs``): the hidden states entering the
next layer and what the model hands every layer besides, captured with stand-ins for the layers."""
from __future__ import annotations

import torch

from zoo.editing import distributed
from zoo.moe import context, routing_context
from zoo.moe.layout import decoder_layers, get_block, put_block


class NeedsRecording(Exception):
    """The layers take positional inputs or hand each other more than hidden states: stand-ins cannot capture them."""


class _Stop(Exception):
    """Raised inside a forward once what was wanted has been recorded."""


def block_call(block, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows ``[T, H]`` a block is called on, and the router state ``[T, R]`` handed in beside them (to a block
    that carries one, ``SparseMoE.carries_router_state``: its second input; else None)."""
    rows, state = args[0].reshape(-1, args[0].shape[-1]), None
    if getattr(block, "carries_router_state", False):
        state = args[1] if len(args) > 1 else kwargs.get("router_state")
    return rows, state.reshape(rows.shape[0], -1) if torch.is_tensor(state) else None


def call_model(model, batch):
    if isinstance(batch, dict):
        return model(**batch, use_cache=False)
    if getattr(model.config, "is_encoder_decoder", False):  # the decoder reads the same text, teacher-forced
        shift = getattr(model, "_shift_right", None)
        return model(input_ids=batch, decoder_input_ids=shift(batch) if shift else batch, use_cache=False)
    return model(input_ids=batch, use_cache=False)


class LayerInputs:
    """Per calibration batch, the hidden states entering the next layer, per layer the keyword arguments the
    model passes to it (masks, rotary tables: computed once by the model's own forward), and the routing
    context of the batch (published again whenever a layer runs, for routers that read it)."""

    def __init__(self, hidden: list[torch.Tensor], kwargs: list[list[dict]], contexts: list | None = None):
        self.hidden, self.kwargs = hidden, kwargs
        self.contexts = contexts or [None] * len(hidden)
        self.batches: list | None = None  # the calibration batches themselves (set for the layer-0 inputs)
        self.router_state = None  # [T, R] handed in beside the rows the last ``block_inputs`` returned (Zaya), or None

    def joined_context(self):
        """One context for the tokens of every batch together (the rows ``block_inputs`` returns, with the router
        state they were handed), or None."""
        if any(c is None for c in self.contexts):
            return None if self.router_state is None else context.RoutingContext(router_state=self.router_state)
        fields = {}
        for name in ("input_ids", "positions", "attention_mask", "modality"):
            values = [getattr(c, name) for c in self.contexts]
            if all(v is not None for v in values):  # every rank's tokens, as block_inputs gives them
                rows = distributed.gather_tokens(torch.cat([v.reshape(-1) for v in values])[:, None])
                fields[name] = rows.reshape(1, -1)
        return context.RoutingContext(**fields, router_state=self.router_state)

    def gathered(self, seen: list, states: list) -> torch.Tensor:
        """The rows ``seen`` of every batch (under a process group, every rank's share); the router states handed in
        beside them are kept for ``joined_context``."""
        known = bool(states) and all(s is not None for s in states)
        self.router_state = distributed.gather_tokens(torch.cat(states)) if known else None
        return distributed.gather_tokens(torch.cat(seen))

    @classmethod
    @torch.no_grad()
    def capture(cls, model, batches) -> LayerInputs:
        """Run each batch through the embeddings only (the decoder layers are stood in for, the rest skipped).
        ``NeedsRecording`` where the layers take positional inputs or hand each other more than hidden states
        (``zoo.editing.layerwise.capture_inputs`` then records the model's real forward)."""
        layers = decoder_layers(model)
        hidden, kwargs, contexts = [], [], []
        for batch in batches:
            seen: list[dict] = []
            returned = []

            def stand_in(h, *args, i, **kw):
                if i == 0:
                    hidden.append(h)
                    contexts.append(context.current())  # published by the model call, if a router reads it
                elif h is not returned[-1]:
                    raise TypeError("a layer's hidden states are not what the previous layer returned")
                seen.append(kw)
                if args:
                    raise TypeError("decoder layers are expected to take their extra inputs as keywords")
                if i == len(layers) - 1:
                    raise _Stop  # every layer's inputs are known: nothing after the layers is needed
                returned.append(h)
                return h

            for i, layer in enumerate(layers):
                layer.forward = lambda h, *a, i=i, **kw: stand_in(h, *a, i=i, **kw)
            more = None
            try:
                call_model(model, batch)
                # the last layer never ran: layers inside layers (ERNIE-4.5-VL's per-modality parts)
                more = TypeError("the model's forward does not call every listed layer in turn")
            except _Stop:
                pass
            except (ValueError, TypeError) as exc:  # the layers take, or hand on, more than the engine carries
                more = exc
            finally:
                for layer in layers:
                    layer.__dict__.pop("forward", None)
            if more is not None:
                raise NeedsRecording(str(more))
            kwargs.append(seen)
        return cls(hidden, kwargs, contexts)

    def block_inputs(self, i: int, layer) -> torch.Tensor:
        """The tokens ``[T, H]`` that enter layer i's MLP block (its attention runs; the block does not); under a
        process group, the tokens of every rank's share."""
        seen, states = [], []

        def record(module, args, kwargs):
            rows, state = block_call(module, args, kwargs)
            seen.append(rows)
            states.append(state)
            raise _Stop

        handle = get_block(layer).register_forward_pre_hook(record, with_kwargs=True)
        try:
            with torch.no_grad():
                for h, kw, ctx in zip(self.hidden, self.kwargs, self.contexts):
                    try:
                        with routing_context(ctx):
                            layer(h, **kw[i])
                    except _Stop:
                        pass
        finally:
            handle.remove()
        return self.gathered(seen, states)  # every rank's share, in the one-process order

    def to(self, device) -> LayerInputs:
        """These inputs with every tensor (hidden states, the keyword inputs, the contexts) on ``device``."""
        from zoo.editing.device import to

        out = LayerInputs(to(self.hidden, device), to(self.kwargs, device), to(self.contexts, device))
        out.batches = self.batches  # token ids stay where the tokenizer put them (only counted and recorded)
        return out

    def advance(self, i: int, layer, block=None) -> LayerInputs:
        """The inputs of layer i + 1: these run through layer i (with ``block`` as its MLP, if given)."""
        old = get_block(layer)
        if block is not None:
            put_block(layer, block)
        try:
            with torch.no_grad():
                out = []
                for h, kw, ctx in zip(self.hidden, self.kwargs, self.contexts):
                    with routing_context(ctx):
                        out.append(layer(h, **kw[i]))
        finally:
            put_block(layer, old)
        return LayerInputs([o[0] if isinstance(o, tuple) else o for o in out], self.kwargs, self.contexts)
