"""top-p: dynamic routing of Huang et al. 2024 ("Harder Tasks Need More Experts"): per token, the smallest set of
experts (most probable first) whose softmax mass reaches p; ``max_k`` (default: all experts, the paper's rule) is
the zoo's optional cap. Weights are renormalised over the kept set. Fixed [T, max_k] output, empty slots marked
E, and no host syncs, so it compiles with fullgraph=True. The paper's dynamic (entropy) loss is a training
objective and is not part of this router."""
import math

import torch
import torch.nn.functional as F

from zoo.moe import Router, Routing
from zoo.demo_controls import Control, layer_experts


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

    def __init__(self, hidden_size, num_experts, top_k, p: float = 0.5, max_k: int | None = None, **options):
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1 or math.isnan(p):
            raise ValueError(f"p must be a probability mass in (0, 1], got {p!r}")
        if max_k is not None and (isinstance(max_k, bool) or not isinstance(max_k, int)
                                  or not 1 <= max_k <= num_experts):
            raise ValueError(f"max_k must be an integer in [1, {num_experts}] (or None for all experts), got {max_k!r}")
        super().__init__(hidden_size, num_experts, top_k, p=float(p), max_k=max_k, **options)
        self.p, self.max_k = float(p), int(num_experts if max_k is None else max_k)

    def forward(self, hidden: torch.Tensor) -> Routing:
        logits = self.gate_logits(hidden)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        top, order = probs.topk(self.max_k, dim=-1)  # most probable first
        # Keep an expert while the mass of the more probable ones is still short of p: the first always stays.
        keep = (top.cumsum(-1) - top) < self.p
        weights = torch.where(keep, top, 0.0)
        weights = weights / weights.sum(-1, keepdim=True)
        indices = torch.where(keep, order, self.num_experts)
        return Routing(weights=weights.to(hidden.dtype), indices=indices, logits=logits)
