"""The layer-at-a-time engine behind every component that changes weights.

One decoder layer is worked on at a time, whether the model is in memory (``zoo.apply``) or streamed from its
shards (``zoo.editing.stream``): the same code runs on both, so they give the same tensors.

Calibration hidden states are carried from layer to layer (as GPTQ and llm-compressor do): a step sees, at
layer i, the inputs that layers 0..i-1 produce *after* that step (and every step before it) changed them (layers
that take positional inputs or hand each other more than hidden states: ``zoo.editing.layer_calls``, in memory). A
step that needs a global view (``needs_plan``) first gets a statistics pass (``observe`` per layer, then
``plan`` once), on the inputs the layers produce before that step changes them.

The per-layer contract (a ``Compressor`` implements it; see docs/plugins/compressor.md)::

    inputs_for: tuple          phases that receive layer inputs: "observe", "compress" (or neither)
    needs_plan: bool           run observe()/plan() in a first pass
    plan_needs_model: bool     plan(model, inputs) instead: scores its plan on the whole model (in memory only)
    check_layer(i, block)      raise before anything changes if the block cannot be worked on
    observe(i, block, x)       x: [T, H] tokens entering the block, or None
    plan()                     once, after every layer was observed
    compress_layer(i, block, x) -> block   a new SparseMoE (or the same one, unchanged)
    targets_linears: bool      also hand it the plain linears outside the MoE blocks:
    check_linear(path, linear)     raise before anything changes
    compress_linear(path, linear) -> module   after the layer's blocks (the LM head after the last layer)
"""
from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

from zoo.editing import distributed, layer_calls
from zoo.editing.layer_inputs import LayerInputs, NeedsRecording
from zoo.editing.phases import phase
from zoo.moe.layout import decoder_layers, get_block, layer_block_attr, layer_prefix, moe_layers, put_block
from zoo.moe import SparseMoE, routing_context
from zoo.moe.cpu_precision import is_plain_linear


def capture_inputs(model, batches) -> LayerInputs:
    """The layer inputs of ``batches``: captured with stand-ins for the layers (``LayerInputs.capture``), or, where the
    layers take positional inputs or hand each other more than hidden states, recorded from the model's real forward
    (``zoo.editing.layer_calls``), which needs the layers in memory."""
    try:
        return LayerInputs.capture(model, batches)
    except NeedsRecording as reason:
        if not layer_calls.in_memory(decoder_layers(model)):
            raise ValueError(f"{type(model).__name__}'s decoder layers take or hand each other more than hidden "
                             f"states and keyword inputs ({reason}); components that calibrate layer by layer need "
                             "such a model in memory, not streamed from its shards") from None
        return layer_calls.capture(model, batches)


def layer_linears(layer) -> list[tuple[str, nn.Linear]]:
    """(path in the layer, module) of a decoder layer's plain linears outside its MoE block (the attention
    projections; a dense layer's MLP). Routers and expert stacks are not ``nn.Linear``s; shared experts sit in the
    block, which compressors work on whole."""
    block = get_block(layer)
    skip = f"{layer_block_attr(layer)}." if isinstance(block, SparseMoE) else None
    return [(name, m) for name, m in layer.named_modules()
            if is_plain_linear(m) and not (skip and f"{name}.".startswith(skip))]


def outer_linears(model) -> list[tuple[str, nn.Linear]]:
    """The LM head, when it is a plain linear with weights of its own (a tied head is the input embedding)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not is_plain_linear(head) or (embed is not None and head.weight is getattr(embed, "weight", None)):
        return []
    return [(name, m) for name, m in model.named_modules() if m is head][:1]


def set_module(root, path: str, module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def compress_linears(steps, root, linears, prefix: str = "") -> dict:
    """``{path under root: new module}`` from every step that targets linears, each step seeing the previous
    one's result (a module a step replaced is no longer a plain linear: later steps leave it)."""
    new = {}
    for step in steps:
        if not getattr(step, "targets_linears", False):
            continue
        for path, linear in linears:
            current = new.get(path, linear)
            if is_plain_linear(current):
                out = step.compress_linear(prefix + path, current)
                if out is not current:
                    new[path] = out
    return new


class InMemory:
    """The layers of a model in memory; new blocks are swapped in only when every layer has succeeded. With a
    ``device``, each layer is moved there while it is worked on and back to the CPU after (its parameters keep
    their identity and values: a failure leaves the model as it was)."""

    def __init__(self, model, device=None):
        self.model, self.device = model, device
        self.layers = decoder_layers(model)
        self.new: dict[int, SparseMoE] = {}
        self.new_linears: list[tuple[nn.Module, str, nn.Module]] = []  # (owner, path, new module)

    def keep_linears(self, i, layer, modules: dict):
        self.new_linears += [(layer, path, to_host(m, self.device)) for path, m in modules.items()]

    def load_layer(self, i):
        return to_device(self.layers[i], self.device)

    def replaced(self, i, layer, block):
        pass  # the old block stays in place until commit()

    def keep(self, i, layer, block):
        if block is not get_block(layer):
            self.new[i] = to_host(block, self.device)

    def release(self, i):
        to_host(self.layers[i], self.device)

    def commit(self):
        for i, block in self.new.items():
            put_block(self.layers[i], block)
        for owner, path, module in self.new_linears:
            set_module(owner, path, module)


def to_device(module, device):
    """``module`` moved (in place) to the engine's device; as it is without one."""
    return module if device is None else module.to(device)


def to_host(module, device):
    """``module`` moved (in place) back to the CPU, where layers are written and kept, if the engine moved it."""
    return module if device is None else module.to("cpu")


class PlannedExperts:
    """The experts an earlier step of the recipe will leave in a layer, as far as a later step's check can tell
    before anything runs: their kind's ``name`` and sizes (not an ``Experts``: no check that wants dense experts
    takes them)."""

    def __init__(self, name: str, like, num_experts: int):
        self.name, self.num_experts = name, num_experts
        self.hidden_size = getattr(like, "hidden_size", None)
        self.intermediate_size = getattr(like, "intermediate_size", None)


class PlannedBlock:
    """A block as the steps before will leave it (experts kind and count); everything else is the block's."""

    def __init__(self, block, experts, num_experts: int):
        self._block, self.experts, self.num_experts = block, experts, num_experts

    def __getattr__(self, name):
        return getattr(self._block, name)


def check(model, steps) -> None:
    """Every step's preconditions on every MoE layer, before anything is computed or changed; a later step is judged
    on the layer as the earlier steps will leave it (a prune after a quantize is refused here, as it is in memory,
    not after the quantize ran)."""
    layers = moe_layers(model)
    planned = {i: (block, block.num_experts) for i, block in layers}  # (the block or its stand-in, expert count)
    for step in steps:
        step.check_layers([i for i, _ in layers])
        for i, _block in layers:
            step.check_layer(i, planned[i][0])
        kind, count = getattr(step, "experts_after", None), getattr(step, "experts_count_after", None)
        if kind is not None or count is not None:
            for i, block in layers:
                now, n = planned[i]
                n = min(n, count) if count is not None else n
                experts = PlannedExperts(kind, block.experts, n) if kind is not None else (
                    now.experts if isinstance(now, PlannedBlock) else block.experts)
                planned[i] = (PlannedBlock(block, experts, n), n)
        if getattr(step, "targets_linears", False):
            for i, layer in enumerate(decoder_layers(model)):
                for path, linear in layer_linears(layer):
                    step.check_linear(layer_prefix(model, i) + path, linear)
            for path, linear in outer_linears(model):
                step.check_linear(path, linear)


def run(source, steps, inputs: LayerInputs | None, keep=None, desc: str = "layers") -> None:
    """All passes of ``steps`` over ``source``: one statistics pass per step that needs a plan, then the pass
    that changes the layers; ``keep(i, layer, block)`` receives each layer's final block. The hidden states are
    carried on ``source.device`` (if it names one)."""
    device = getattr(source, "device", None)
    carried = inputs if inputs is None or device is None else inputs.to(device)
    for s, step in enumerate(steps):
        if getattr(step, "needs_plan", False):
            one_pass(source, steps[:s], carried, observer=step, desc=f"{desc}: {step.name} statistics")
            # a step that scores its plan on the whole model (in memory only: streaming refuses it up front), where
            # the model is: on its own device, with the inputs as captured
            step.plan(source.model, inputs) if getattr(step, "plan_needs_model", False) else step.plan()
    one_pass(source, steps, carried, keep=keep or source.keep, desc=f"{desc}: {', '.join(s.name for s in steps)}")


def one_pass(source, steps, inputs, observer=None, keep=None, desc="layers") -> None:
    uses = [inputs if "compress" in getattr(s, "inputs_for", ()) else None for s in steps]
    watch = inputs if observer is not None and "observe" in getattr(observer, "inputs_for", ()) else None
    device = getattr(source, "device", None)
    for i in tqdm(range(len(source.layers)), desc=desc, leave=False):
        with phase("read"):
            layer = source.load_layer(i)
        try:
            block = get_block(layer)
            if isinstance(block, SparseMoE):
                for s, step in enumerate(steps):
                    with phase("calibrate"):
                        x = None if uses[s] is None else uses[s].block_inputs(i, layer)
                    with phase("compress"), routing_context(None if uses[s] is None else uses[s].joined_context()):
                        # a new block built on the CPU joins the layer's device (the next step and the carry run there)
                        block = to_device(step.compress_layer(i, block, x), device)
                    del x
                    source.replaced(i, layer, block)  # streaming: the old block is freed here
                    if uses[s] is not None and i + 1 < len(source.layers):
                        with phase("calibrate"):
                            uses[s] = uses[s].advance(i, layer, block)
                if observer is not None:
                    with phase("statistics pass"):
                        x = None if watch is None else watch.block_inputs(i, layer)  # the context joins its rows
                        with routing_context(None if watch is None else watch.joined_context()):
                            observer.observe(i, block, x)
                        del x
                        if watch is not None and i + 1 < len(source.layers):
                            watch = watch.advance(i, layer, block)
            else:  # a dense layer: every carried input goes through it unchanged (once per distinct carry)
                done: dict[int, LayerInputs] = {}
                for c in [*uses, watch]:
                    if c is not None and id(c) not in done:
                        with phase("calibrate"):
                            done[id(c)] = c.advance(i, layer)
                uses = [None if c is None else done[id(c)] for c in uses]
                watch = None if watch is None else done[id(watch)]
            if keep is not None:
                linears = compress_linears(steps, layer, layer_linears(layer), layer_prefix(source.model, i))
                if linears:
                    source.keep_linears(i, layer, linears)
                with phase("write"):
                    keep(i, layer, block)
        finally:
            source.release(i)


def calibration_inputs(model, steps, calibration) -> LayerInputs | None:
    """The layer-0 inputs of the calibration data, if any step looks at layer inputs (the shipped corpus'
    mixed domains, 8192 tokens, when none is given: ``zoo.editing.calibration.default()``, which the recipe records),
    tokenized with the model's own tokenizer."""
    if not any(getattr(s, "inputs_for", ()) for s in steps):
        return None
    from zoo.editing import calibration as calib
    from zoo.io.loading import tokenizer_for

    data = calibration if calibration is not None else calib.default()
    text = model.config.get_text_config()
    if isinstance(data, dict):  # refused before a single window is drawn
        calib.check_memory(calib.tokens_used(data), text.hidden_size, model.dtype)
    batches = calib.batches(data, tokenizer_for(model) if calib.needs_tokenizer(data) else None)
    calib.check_ids(batches, getattr(text, "vocab_size", None))
    calib.check_memory(sum(b.numel() for b in batches), text.hidden_size, model.dtype)
    inputs = capture_inputs(model, distributed.share_windows(batches))  # under a process group: this rank's share
    inputs.batches = batches
    return inputs


def compress_in_memory(model, steps, calibration=None, device=None):
    """Run layer-wise ``steps`` on a model in memory; the model changes only if every layer succeeds. ``device``
    (default: ``zoo.editing.device.using``'s, else none): each layer is calibrated and compressed there, one at a
    time, and moved back to the CPU; the model must then be on the CPU."""
    from zoo.editing import device as devices

    dev = devices.resolve(device) if device is not None else devices.current()
    if dev is not None:
        where = {p.device for p in model.parameters() if not p.is_meta}
        if where - {torch.device("cpu")}:
            raise ValueError(f"device={str(dev)!r} moves each layer from the CPU and back, but this model is on "
                             f"{', '.join(sorted(map(str, where)))}: leave device out to work where the model is")
    check(model, steps)
    was_training = model.training
    model.eval()
    try:
        source = InMemory(model, dev)
        run(source, steps, calibration_inputs(model, steps, calibration), desc="compressing")
        source.keep_linears(None, model, compress_linears(steps, model, outer_linears(model)))
        source.commit()
    finally:
        model.train(was_training)
    return model
