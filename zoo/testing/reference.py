"""Fast path against reference: a router or experts module that declares ``reference`` must match it, outputs
and gradients, on random inputs (an empty routing slot included)."""
from __future__ import annotations

import copy

import torch

from zoo.testing.outputs import max_diff, unwrapped

# Fast path vs reference: the same arithmetic in another order (sorted dispatch vs one pair at a time).
REFERENCE_TOLERANCE = 1e-5


def check_references(case, where) -> list[str]:
    """Compare every part class the step added (all of them for an architecture) with its ``reference``."""
    from zoo.moe.layout import moe_layers

    model, checked = unwrapped(case["model"]), []
    for _, moe in moe_layers(model):
        for part in (moe.router, moe.experts):
            cls = type(part)
            if cls.__name__ in checked or getattr(cls, "reference", None) is None or \
                    (case["new"] is not None and cls not in case["new"]):
                continue
            check_reference(part, moe.top_k, where=where)
            checked.append(cls.__name__)
    return checked


def check_reference(module, top_k: int = 2, tokens: int = 12, seed: int = 0, where: str = "") -> None:
    """A router's or experts module's ``forward`` against its ``reference`` on seeded random inputs: outputs, then
    gradients (of the input, the routing weights and the parameters) of a random projection of the float outputs.
    Experts get a routing with distinct experts per token and one empty slot (index E); router outputs are
    compared slot by slot in expert order, with the weights of empty slots (ignored by contract) zeroed. A router
    that reads the routing context gets one with seeded token ids and positions, the same for both; one that carries
    a state from layer to layer, a seeded previous state (and its own state is compared too)."""
    from zoo.moe import Router, Routing, RoutingContext

    g = torch.Generator().manual_seed(seed)
    if isinstance(module, Router):  # in float64: a router's renormalised weights nearly cancel in their gradients,
        module = copy.deepcopy(module).double()  # whose fp32 noise is then as large as what they are
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    hidden = torch.randn(tokens, module.hidden_size, generator=g).to(dtype).requires_grad_()
    leaves, E = [hidden], module.num_experts
    if isinstance(module, Router):
        names = ["indices", "weights", "logits", "shared_weights", "state"]
        context, carried = None, {}
        if module.carries_state:  # the previous layer's state, as wide as the one this router hands on
            width = module(hidden.detach()[:1]).state.shape[-1]
            carried = {"state": torch.randn(tokens, width, generator=g).to(dtype)}
        if module.uses_context:
            vocab = int(module.options.get("vocab_size", 64))
            context = RoutingContext(input_ids=torch.randint(vocab, (1, tokens), generator=g),
                                     positions=torch.arange(tokens)[None], attention_mask=torch.ones(1, tokens))

        def outputs(fn):
            r = fn(hidden, context, **carried) if module.uses_context else fn(hidden, **carried)
            order = r.indices.argsort(dim=-1, stable=True)
            indices = r.indices.gather(-1, order)
            weights = r.weights.gather(-1, order).masked_fill(indices >= E, 0)
            return [indices, weights] + [t for t in (r.logits, r.shared_weights, r.state) if t is not None]
    else:
        names = ["output"]
        indices = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(tokens)])
        if top_k > 1:
            indices[0, -1] = E  # an empty slot: its weight is ignored
        weights = torch.rand(tokens, top_k, generator=g).to(dtype).requires_grad_()
        leaves.append(weights)

        def outputs(fn):
            return [fn(hidden, Routing(weights=weights, indices=indices))]
    training = module.training
    module.eval()
    try:
        fast, ref = outputs(module), outputs(module.reference)
        for label, a, b in zip(names, fast, ref):
            _close(a, b, f"{where}: {type(module).__name__}.forward vs its reference, {label}")
        floats = [i for i, t in enumerate(fast) if t.is_floating_point() and t.requires_grad]
        if not floats:
            return
        directions = [torch.randn(fast[i].shape, generator=g).to(fast[i].dtype) for i in floats]
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        wrt = leaves + [p for _, p in named]
        labels = ["the input", "the routing weights"][:len(leaves)] + [f"parameter {n}" for n, _ in named]
        grads = [torch.autograd.grad(sum((out[i] * d).sum() for i, d in zip(floats, directions)), wrt,
                                     allow_unused=True) for out in (fast, ref)]
        for label, a, b in zip(labels, *grads):
            if a is None and b is None:
                continue
            a, b = (torch.zeros_like(b) if a is None else a), (torch.zeros_like(a) if b is None else b)
            _close(a, b, f"{where}: {type(module).__name__} gradient of {label} vs its reference's")
    finally:
        module.train(training)


def _close(a, b, what) -> None:
    if a.shape != b.shape:
        raise AssertionError(f"{what}: shapes {tuple(a.shape)} and {tuple(b.shape)} differ.")
    if not a.is_floating_point():
        if not torch.equal(a, b):
            raise AssertionError(f"{what}: {int((a != b).sum())} of {a.numel()} values differ.")
        return
    diff, scale = max_diff(a.float(), b.float()), b.float().abs().max().item() if b.numel() else 0.0
    if diff > REFERENCE_TOLERANCE * max(scale, 1e-6):
        raise AssertionError(f"{what}: differ by up to {diff:.3g} (largest value {scale:.3g}).")
