"""adamoe: AdaMoE's decoupled router (Shen et al., 2025, arXiv:2510.14300). Selection and weighting come from two
independent linear maps of the token x:

    p = softmax(W_r x)                        the router: its probabilities pick the experts
    S = TopK(p, k)
    s = W_s x                                 the scale adapter (linear, no activation, no normalisation)
    w_e = routed_scale * (p_e + s_e)  for e in S

``logits`` are the router's ``W_r x`` alone, so the load-balancing (and z-) loss reaches only the router: it may
spread tokens over the experts while the scale adapter, trained by the task loss alone, sets how much each chosen
expert counts. The kept probabilities are not renormalised (as in the paper); ``routed_scale`` 0.5 with a shared
expert at 0.5 is the paper's layer, half dense FFN and half routed experts (``upcycle`` with ``router="adamoe"``
builds it).
"""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from zoo.components.controls import Control, layer_top_k
from zoo.moe import Router, Routing
from zoo.components.options import check_float


class AdaMoE(Router):
    name = "adamoe"
    summary = ("AdaMoE: the router's softmax top-k selects the experts, an independent linear scale adapter adds "
               "to their weights (selection decoupled from weighting).")
    paper = ("Shen et al., Expertise need not monopolize: Action-Specialized Mixture of Experts for "
             "Vision-Language-Action Learning, 2025. arXiv:2510.14300")
    card = "cards/adamoe.md"
    space = "router-explorer"

    @classmethod
    def demo_controls(cls, model=None):
        return [*super().demo_controls(model)[:1],
                Control("routed_scale", "float", 1.0, low=0.1, high=2.0, step=0.1,
                        help="factor on the routed weights (0.5 beside a shared expert at 0.5: the paper's layer)")]

    @classmethod
    def demo_presets(cls, model=None):
        k = layer_top_k(model) or 2
        return {"mild": {"top_k": k}, "strong": {"top_k": 1}}

    def __init__(self, hidden_size, num_experts, top_k, routed_scale: float = 1.0, **options):
        routed_scale = check_float("routed_scale", routed_scale, 0.0)
        if not routed_scale > 0:
            raise ValueError(f"routed_scale must be positive, got {routed_scale!r}")
        super().__init__(hidden_size, num_experts, top_k, routed_scale=routed_scale, **options)
        self.routed_scale = routed_scale
        # W_s [E, H]: its own parameters, never derived from the router's logits (the paper's decoupling)
        self.scale_adapter = nn.Parameter(torch.empty(num_experts, hidden_size))
        nn.init.normal_(self.scale_adapter, std=0.02)

    def init_weights(self, std: float) -> None:
        super().init_weights(std)
        init.normal_(self.scale_adapter, mean=0.0, std=std)  # as the gate: the paper draws both from one normal

    def forward(self, hidden: torch.Tensor) -> Routing:
        logits = self.gate_logits(hidden)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        top, indices = probs.topk(self.top_k, dim=-1)
        # the adapter's [T, E] row, read at the chosen experts (E is small: one GEMM beats gathering W_s rows)
        scale = F.linear(hidden, self.scale_adapter).float().gather(1, indices)
        weights = (top + scale) * self.routed_scale
        return Routing(weights=weights.to(hidden.dtype), indices=indices, logits=logits)

    def reference(self, hidden: torch.Tensor) -> Routing:
        """Token by token: the k most probable experts, each weighted by its probability plus its own adapter row's
        dot product with the token."""
        logits = hidden @ self.weight.T + (0 if self.bias is None else self.bias)
        weights, indices = [], []
        for t in range(hidden.shape[0]):
            p = torch.softmax(logits[t].float(), dim=-1)
            chosen = torch.argsort(p, descending=True, stable=True)[: self.top_k]
            indices.append(chosen)
            weights.append(torch.stack([(p[e] + (hidden[t] * self.scale_adapter[e]).sum().float())
                                        * self.routed_scale for e in chosen]))
        return Routing(weights=torch.stack(weights).to(hidden.dtype), indices=torch.stack(indices), logits=logits)
