"""top-p: dynamic routing of Huang et al. 2024 ("Harder Tasks Need More Experts"): per token, the smallest set of
experts (most probable first) whose softmax mass reaches p; ``max_k`` (default: all experts, the paper's rule) is
the zoo's optional cap. Weights are renormalised over the kept set. Fixed [T, max_k] output, empty slots marked
E, and no host syncs, so it compiles with fullgraph=True.

Training (``moe-zoo finetune MODEL --adapter top-p``): the paper's dynamic loss, the mean entropy of the routing
distribution ``-sum_e P_e log P_e`` times ``dynamic_loss_coef`` (the paper's 1e-4), is the router's
``train_loss()``; the gates are what trains (``trainable_parameters``), beside the model's balance loss. Without
it a router can flatten its distribution and take every expert."""
import math

import torch
import torch.nn.functional as F

from torch import nn

from zoo.components.controls import Control, layer_experts
from zoo.moe import Router, Routing
from zoo.components.options import check_float


class TopP(Router):
    name = "top-p"
    summary = "Dynamic top-p routing: per token, the fewest experts whose softmax mass reaches p (optionally capped)."
    paper = ("Huang et al., Harder Tasks Need More Experts: Dynamic Routing in MoE Models, ACL 2024, "
             "arXiv:2403.07652")
    card = "cards/top-p.md"
    space = "router-explorer"

    @classmethod
    def demo_controls(cls, model=None):
        n = layer_experts(model)
        return [Control("p", "float", 0.5, low=0.05, high=1.0, step=0.05, help="probability mass to reach"),
                Control("max_k", "int", None, low=1, high=n or 8, step=1, optional=True,
                        help="at most this many experts (empty: all)")]

    @classmethod
    def demo_presets(cls, model=None):
        return {"mild": {"p": 0.8}, "strong": {"p": 0.3}}   # more, then fewer, experts than top-k on peaked tokens

    def __init__(self, hidden_size, num_experts, top_k, p: float = 0.5, max_k: int | None = None,
                 dynamic_loss_coef: float = 1e-4, **options):
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1 or math.isnan(p):
            raise ValueError(f"p must be a probability mass in (0, 1], got {p!r}")
        if max_k is not None and (isinstance(max_k, bool) or not isinstance(max_k, int)
                                  or not 1 <= max_k <= num_experts):
            raise ValueError(f"max_k must be an integer in [1, {num_experts}] (or None for all experts), got {max_k!r}")
        dynamic_loss_coef = check_float("dynamic_loss_coef", dynamic_loss_coef, 0.0)
        super().__init__(hidden_size, num_experts, top_k, p=float(p), max_k=max_k,
                         dynamic_loss_coef=dynamic_loss_coef, **options)
        self.p, self.max_k = float(p), int(num_experts if max_k is None else max_k)
        self.dynamic_loss_coef = dynamic_loss_coef
        self.entropy: torch.Tensor | None = None  # mean routing entropy of the last training forward

    def trainable_parameters(self) -> list[nn.Parameter]:
        """What ``moe-zoo finetune`` trains: the gate (the experts and the rest of the model stay frozen)."""
        return [p for p in (self.weight, self.bias) if p is not None]

    def train_loss(self) -> torch.Tensor | None:
        """The paper's dynamic loss: ``dynamic_loss_coef`` x the mean routing entropy of the last training forward."""
        return None if self.entropy is None else self.dynamic_loss_coef * self.entropy

    def forward(self, hidden: torch.Tensor) -> Routing:
        logits = self.gate_logits(hidden)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        self.entropy = -(probs * F.log_softmax(logits.float(), dim=-1)).sum(-1).mean() if self.training else None
        top, order = probs.topk(self.max_k, dim=-1)  # most probable first
        # Keep an expert while the mass of the more probable ones is still short of p: the first always stays.
        keep = (top.cumsum(-1) - top) < self.p
        weights = torch.where(keep, top, 0.0)
        weights = weights / weights.sum(-1, keepdim=True)
        indices = torch.where(keep, order, self.num_experts)
        return Routing(weights=weights.to(hidden.dtype), indices=indices, logits=logits)
