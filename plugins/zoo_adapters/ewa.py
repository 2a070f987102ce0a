"""ewa: Experts Weights Averaging. While training, tokens are assigned to experts by a random uniform partition
(``routing="random-partition"``, the paper's: each layer splits the batch's tokens, in a fresh random order,
into E equal groups, one expert each, weight 1; no router decides), and after every optimizer step each
expert's weights move toward the mean of the layer's experts, ``W_e <- (1 - beta) W_e + beta * mean_j W_j``;
at the end the MoE collapses into one FFN per layer whose weights are the experts' plain average.
``routing="router"`` (the zoo's variant) keeps the model's own router while training.

``zoo.apply(model, "ewa", beta=0.1)`` records the step; ``Ewa.from_model(model).register(optimizer, model)``
then routes by random partition in training mode and averages after every ``optimizer.step()`` (or call
``train_step(model)`` yourself, and ``route_by_partition(model)`` for the routing).
``zoo.apply(model, "ewa", collapse=True)`` collapses: each layer keeps one expert (the average), with top-1
routing over that single expert. It stays a zoo model of the same family (saves, reloads and keeps its
recipe; a Mixtral exports as a native Mixtral with one expert), and computes a dense FFN: a one-expert
softmax router always gives weight 1. Shared experts are kept.
"""
from __future__ import annotations

import torch

from zoo import Adapter
from zoo.moe.layout import moe_layers, replace_blocks
from zoo.moe import Routing
from zoo.moe.surgery import merge_experts
from zoo.components.options import check_float
from zoo.components.controls import Control


ROUTINGS = ("random-partition", "router")


def partition_routing(tokens: int, num_experts: int, generator: torch.Generator | None = None,
                      device=None, dtype=torch.float32) -> Routing:
    """A random uniform partition of ``tokens`` tokens over ``num_experts`` experts: a random permutation of the
    tokens dealt out in turn, so every expert gets ``tokens // E`` or one more; one expert per token, weight 1."""
    order = torch.randperm(tokens, generator=generator)
    indices = torch.empty(tokens, dtype=torch.long)
    indices[order] = torch.arange(tokens) % num_experts
    return Routing(weights=torch.ones(tokens, 1, dtype=dtype, device=device), indices=indices[:, None].to(device))


class _Handles:
    """Several hook handles removed together."""

    def __init__(self, handles):
        self.handles = list(handles)

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []


def _averaged_rows(state: dict, mix: torch.Tensor) -> dict:
    """The single merged expert's router state: ``mix`` [1, E] applied to every per-expert tensor."""
    E = mix.shape[1]
    return {k: (torch.einsum("ne,e...->n...", mix, v.float()).to(v.dtype) if v.dim() and v.shape[0] == E else v)
            for k, v in state.items()}


class Ewa(Adapter):
    name = "ewa"
    summary = "Experts Weights Averaging: pull experts toward their mean after each step; collapse to one FFN."
    paper = ("Huang et al., Experts Weights Averaging: A New General Training Scheme for Vision Transformers, "
             "2023, arXiv:2308.06093")
    card = "cards/ewa.md"
    space = "model-zoo"

    @classmethod
    def demo_controls(cls, model=None):
        return [Control("beta", "float", 0.1, low=0.0, high=1.0, step=0.05, help="weight of the expert average"),
                Control("routing", "choice", "random-partition", choices=ROUTINGS,
                        help="training routing: random uniform partition (the paper's) or the model's router"),
                Control("collapse", "bool", False, help="end with every expert equal to the average")]

    @classmethod
    def demo_presets(cls, model=None):
        return {"mild": {"beta": 0.1}, "strong": {"beta": 0.5}}

    def __init__(self, beta: float = 0.1, collapse: bool = False, routing: str = "random-partition", seed: int = 0):
        super().__init__(beta=beta, collapse=collapse, routing=routing, seed=seed)
        self.beta = check_float("beta", beta, 0.0, 1.0)
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        self.routing, self.seed = routing, seed
        if collapse is not True and collapse is not False:
            raise ValueError(f"collapse must be true or false, got {collapse!r}")
        self.collapse = collapse

    def attach(self, model):
        layers = self.check_model(model)
        if self.collapse:
            replace_blocks(model, {i: merge_experts(moe, [list(range(moe.num_experts))], [[1.0] * moe.num_experts],
                                                    _averaged_rows) for i, moe in layers})
        return model

    def check_model(self, model):
        layers = moe_layers(model)
        if not layers:
            raise TypeError("ewa needs an MoE model (a zoo model with SparseMoE layers)")
        for i, moe in layers:
            if moe.experts.name != "swiglu":
                raise TypeError(f"ewa averages dense expert weights; layer {i} has {moe.experts.name!r} experts")
        return layers

    @torch.no_grad()
    def train_step(self, model) -> None:
        """One averaging step on every MoE layer: ``W_e <- (1 - beta) W_e + beta * mean_j W_j``."""
        for _, moe in self.check_model(model):
            for p in moe.experts.parameters():  # gate_up_proj, down_proj (and biases): experts on dim 0
                p.lerp_(p.float().mean(0, keepdim=True).to(p.dtype), self.beta)

    def route_by_partition(self, model):
        """While a block is in training mode, its router's choice is replaced by a random uniform partition of the
        tokens (``partition_routing``; the router logits, where a balance loss reads them, become zeros: nothing to
        balance, no gradient to the router). Eval mode keeps the router. Returns a handle (``.remove()``)."""
        generator = torch.Generator().manual_seed(self.seed)

        def hook(router, args, out):
            if not router.training:
                return out
            x = args[0]
            new = partition_routing(x.shape[0], router.num_experts, generator, x.device, out.weights.dtype)
            return new._replace(logits=None if out.logits is None else torch.zeros_like(out.logits))

        return _Handles(moe.router.register_forward_hook(hook) for _, moe in self.check_model(model))

    def register(self, optimizer, model):
        """Train the paper's way: random-partition routing in training mode (unless ``routing="router"``) and the
        averaging after every ``optimizer.step()``; returns one handle (``.remove()`` stops both)."""
        handles = [optimizer.register_step_post_hook(lambda opt, args, kwargs: self.train_step(model))]
        if self.routing == "random-partition":
            handles.append(self.route_by_partition(model))
        return _Handles(handles)

    @classmethod
    def from_model(cls, model) -> Ewa:
        """The training-time EWA recorded in the model's recipe (the last ``ewa`` step without collapse)."""
        steps = [s for s in model.config.zoo_recipe or [] if s["name"] == cls.name
                 and not s["options"].get("collapse", False)]
        if not steps:
            raise ValueError("no training-time ewa step in this model's recipe: zoo.apply(model, 'ewa', beta=...)")
        opts = steps[-1]["options"]
        return cls(beta=opts.get("beta", 0.1), routing=opts.get("routing", "random-partition"), seed=opts.get("seed", 0))
