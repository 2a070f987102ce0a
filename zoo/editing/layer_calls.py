"""Calibration inputs for models whose decoder layers take positional inputs or hand each other more than hidden
states (the top-k indices of sparse attention, Gemma 4's per-layer inputs, Inkling 2's block states and loop passes).

Each calibration batch runs once through the real model (in memory) with every layer call recorded: its
positional and keyword inputs, and which of them are objects the previous call returned (``links``). The batch is
then carried on in one of two ways, both giving layer i the inputs it gets in a forward of the model whose layers
before i hold their new blocks:

- ``LinkedCalls``: every layer is called once, in order, and every input an earlier layer influences is linked
  (the hidden states, the top-k indices). Linked inputs come from the previous layer's carried outputs, the others
  (masks, rotary tables, per-layer inputs) from the recording: one layer forward per layer, as for the families
  whose layers take keywords and return hidden states.
- ``RerunCalls``: otherwise (inputs the model's loop derives from earlier layers' outputs, a layer called more than
  once, state shared between layers through a mutable argument): the model itself runs until layer i's last call,
  its layers before i holding their new blocks. Exact by construction; its cost grows with the square of the depth.

The choice is made on the first batch: a second forward with noise added to every layer's floating outputs must
leave every unlinked input as recorded, else something the model derives from earlier layers was not linked.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping

import torch

from zoo.editing.layer_inputs import LayerInputs, _Stop, block_call, call_model
from zoo.moe import context, routing_context
from zoo.moe.layout import decoder_layers, get_block, put_block

LINK = object()  # in a recorded call: an input taken from the previous call's outputs at replay


def leaves(obj, path=()):
    """(path, tensor) of every tensor inside nested tuples, lists and mappings (dicts, the shared key/value store)."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, (tuple, list)):
        for k, v in enumerate(obj):
            yield from leaves(v, (*path, k))
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from leaves(v, (*path, k))


def at(obj, path):
    for k in path:
        obj = obj[k]
    return obj


def substitute(obj, values: dict, path=()):
    """``obj`` with the leaves at ``values``' paths replaced; only the containers on those paths are rebuilt (any
    other object, a dict the layers write into included, stays the very same object)."""
    if path in values:
        return values[path]
    if not any(p[:len(path)] == path for p in values):
        return obj
    if isinstance(obj, Mapping):
        new = copy.copy(obj)
        for k, v in obj.items():
            new[k] = substitute(v, values, (*path, k))
        return new
    items = [substitute(v, values, (*path, k)) for k, v in enumerate(obj)]
    if isinstance(obj, list):
        return items
    return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)


class Call:
    """One recorded layer call: the layer's index, its inputs ``(args, kwargs)`` with the linked leaves stood in
    for by ``LINK``, ``links`` {input path: path in the previous call's output}, and (for the probe) the unlinked
    tensors as they were when the call began."""

    def __init__(self, layer: int, inputs, links: dict, snapshot: list):
        self.layer, self.links, self.snapshot = layer, links, snapshot
        self.inputs = substitute(inputs, dict.fromkeys(links, LINK))

    def filled(self, previous_output):
        """(args, kwargs) for a replay whose previous layer returned ``previous_output``."""
        return substitute(self.inputs, {p: at(previous_output, src) for p, src in self.links.items()})


def perturbed(out):
    """``out`` with noise of its own size added to every floating tensor (not a scale: norms would undo it)."""
    noise = torch.Generator().manual_seed(0)

    def shifted(t):
        return t + torch.randn(t.shape, generator=noise).to(t) * t.abs().mean()
    return substitute(out, {p: shifted(t) for p, t in leaves(out) if t.is_floating_point()})


@torch.no_grad()
def record(model, layers, batch, perturb: bool = False) -> tuple[list[Call], object]:
    """Every layer call of one forward of ``batch``, in order, and the routing context the model published (the
    forward stops before the LM head). ``perturb``: noise is added to every layer's floating outputs as they leave."""
    index = {id(layer): i for i, layer in enumerate(layers)}
    calls, state = [], {"previous": None, "context": None}

    def before(module, args, kwargs):
        if not calls:
            state["context"] = context.current()
        inputs = (args, kwargs)
        returned = {}
        for path, t in leaves(state["previous"]):
            returned.setdefault(id(t), path)  # the first place the previous call returned it
        links = {p: returned[id(t)] for p, t in leaves(inputs) if id(t) in returned}
        snapshot = [(p, t) for p, t in leaves(inputs) if p not in links]
        calls.append(Call(index[id(module)], inputs, links, snapshot))

    def after(module, args, kwargs, out):
        out = perturbed(out) if perturb else out
        state["previous"] = out
        return out

    def stop(module, args):
        raise _Stop

    handles = [h for layer in layers for h in (layer.register_forward_pre_hook(before, with_kwargs=True),
                                                 layer.register_forward_hook(after, with_kwargs=True))]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, torch.nn.Module):
        handles.append(head.register_forward_pre_hook(stop))  # the logits are not needed
    try:
        call_model(model, batch)
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    return calls, state["context"]


def links_hold(calls: list[Call], probe: list[Call]) -> bool:
    """Whether the perturbed forward ``probe`` made the same calls with the same links and left every unlinked
    input as recorded in ``calls``."""
    if [(c.layer, c.links) for c in calls] != [(c.layer, c.links) for c in probe]:
        return False
    for c, p in zip(calls, probe):
        theirs = dict(p.snapshot)
        for path, t in c.snapshot:
            other = theirs.get(path)
            if other is None or other.shape != t.shape or other.dtype != t.dtype or not torch.equal(other, t):
                return False
    return True


def in_memory(layers) -> bool:
    return not any(p.is_meta for layer in layers for p in layer.parameters())


@torch.no_grad()
def capture(model, batches) -> LayerInputs:
    """The recorded calls of every batch, carried linearly where the links hold (see the module's docstring)."""
    layers = list(decoder_layers(model))
    recorded = [record(model, layers, batch) for batch in batches]
    calls, contexts = [r[0] for r in recorded], [r[1] for r in recorded]
    in_order = all([c.layer for c in batch_calls] == list(range(len(layers))) for batch_calls in calls)
    if in_order and links_hold(calls[0], record(model, layers, batches[0], perturb=True)[0]):
        for batch_calls in calls:
            for c in batch_calls:
                c.snapshot = []
        return LinkedCalls(calls, [None] * len(calls), contexts)
    counts = [[sum(c.layer == i for c in batch_calls) for i in range(len(layers))] for batch_calls in calls]
    return RerunCalls(model, layers, batches, counts, contexts, {})


class LinkedCalls(LayerInputs):
    """Per batch, the recorded calls of every layer and the carried outputs of the last layer run (None before
    layer 0)."""

    def __init__(self, calls: list[list[Call]], outputs: list, contexts: list):
        super().__init__([], [], contexts)
        self.calls, self.outputs = calls, outputs

    def _calls(self, i):
        """(args, kwargs, routing context) of layer i's call, per batch."""
        for calls, out, ctx in zip(self.calls, self.outputs, self.contexts):
            yield (*calls[i].filled(out), ctx)

    @torch.no_grad()
    def block_inputs(self, i: int, layer) -> torch.Tensor:
        seen, states = [], []

        def take(module, args, kwargs):
            rows, state = block_call(module, args, kwargs)
            seen.append(rows)
            states.append(state)
            raise _Stop

        handle = get_block(layer).register_forward_pre_hook(take, with_kwargs=True)
        try:
            for args, kwargs, ctx in self._calls(i):
                try:
                    with routing_context(ctx):
                        layer(*args, **kwargs)
                except _Stop:
                    pass
        finally:
            handle.remove()
        return self.gathered(seen, states)

    @torch.no_grad()
    def advance(self, i: int, layer, block=None) -> LinkedCalls:
        old = get_block(layer)
        if block is not None:
            put_block(layer, block)
        try:
            outputs = []
            for args, kwargs, ctx in self._calls(i):
                with routing_context(ctx):
                    outputs.append(layer(*args, **kwargs))
        finally:
            put_block(layer, old)
        return LinkedCalls(self.calls, outputs, self.contexts)


class RerunCalls(LayerInputs):
    """The model run again for every layer: ``blocks`` {layer index: new block} are the blocks the layers before
    the current one hold; ``counts[b][i]``: how many times batch b calls layer i."""

    def __init__(self, model, layers, batches, counts, contexts, blocks: dict):
        super().__init__([], [], contexts)
        self.model, self.layers, self.runs, self.counts, self.blocks = model, layers, batches, counts, blocks

    @torch.no_grad()
    def block_inputs(self, i: int, layer) -> torch.Tensor:
        if layer is not self.layers[i]:
            raise ValueError(f"layer {i} is not the model's own: this model is calibrated by running it whole")
        seen, states, count = [], [], [0]

        def take(module, args, kwargs, wanted):
            rows, state = block_call(module, args, kwargs)
            seen.append(rows)
            states.append(state)
            count[0] += 1
            if count[0] == wanted:
                raise _Stop  # layer i's last call of the batch: nothing after it is needed

        old = {j: get_block(self.layers[j]) for j in self.blocks}
        for j, block in self.blocks.items():
            put_block(self.layers[j], block)
        try:
            for batch, counts in zip(self.runs, self.counts):
                if not counts[i]:
                    continue
                count[0] = 0
                handle = get_block(layer).register_forward_pre_hook(lambda m, a, kw, n=counts[i]: take(m, a, kw, n),
                                                                    with_kwargs=True)
                try:
                    call_model(self.model, batch)
                except _Stop:
                    pass
                finally:
                    handle.remove()
        finally:
            for j, block in old.items():
                put_block(self.layers[j], block)
        return self.gathered(seen, states)

    def advance(self, i: int, layer, block=None) -> RerunCalls:
        blocks = self.blocks if block is None or block is get_block(layer) else {**self.blocks, i: block}
        return RerunCalls(self.model, self.layers, self.runs, self.counts, self.contexts, blocks)
