"""sparsemixer: Phi-3.5-MoE's routing (GRIN). Experts are picked one at a time: the best remaining logit wins,
and its weight is its softmax among the logits close enough to it (relative gap at most ``2 * jitter_eps``);
the winner is then masked out for the next pick."""
import torch

from zoo.moe import Router, Routing
from zoo.components.controls import Control


class SparseMixer(Router):
    name = "sparsemixer"
    summary = ("Phi-3.5-MoE routing: k rounds of argmax, each weighted by a softmax over the logits within a "
               "relative gap of 2*jitter_eps of the winner.")
    paper = "Liu et al., GRIN: GRadient-INformed MoE, 2024. arXiv:2409.12136"
    card = "cards/sparsemixer.md"
    space = "router-explorer"

    @classmethod
    def demo_controls(cls, model=None):
        return [*super().demo_controls(model)[:1],
                Control("jitter_eps", "float", 0.01, low=0.0, high=1.0, step=0.01, help="sampling jitter (training)")]

    def __init__(self, hidden_size, num_experts, top_k, jitter_eps: float = 0.01, **options):
        if isinstance(jitter_eps, bool) or not jitter_eps >= 0:
            raise ValueError(f"jitter_eps must be >= 0, got {jitter_eps!r}")
        super().__init__(hidden_size, num_experts, top_k, jitter_eps=float(jitter_eps), **options)
        self.jitter_eps = float(jitter_eps)

    def forward(self, hidden: torch.Tensor) -> Routing:
        logits = self.gate_logits(hidden)
        scores = logits.float()
        remaining = scores
        weights, indices = [], []
        for _ in range(self.top_k):
            with torch.no_grad():
                best, winner = remaining.max(dim=-1, keepdim=True)
                gap = (best - scores) / scores.abs().clamp(min=best)
                far = gap > 2 * self.jitter_eps
            # the softmax runs over the round's candidates (the winner and those close to it)
            candidates = remaining.masked_fill(far, float("-inf"))
            weights.append(candidates.softmax(-1).gather(-1, winner))
            indices.append(winner)
            remaining = remaining.scatter(-1, winner, float("-inf"))
        return Routing(weights=torch.cat(weights, -1).to(hidden.dtype), indices=torch.cat(indices, -1), logits=logits)
