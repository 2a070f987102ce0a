"""expert-choice: experts pick tokens. Softmax over experts per token, then each expert keeps its top-c tokens
(c = ceil(T * capacity_factor / E)); a token may get anywhere from 0 to E experts."""
import math

import torch
import torch.nn.functional as F

from zoo.moe import Router, Routing
from zoo.components.controls import Control, layer_experts


class ExpertChoice(Router):
    name = "expert-choice"
    summary = "Expert choice routing: each expert picks its top-c tokens by softmax score (0..E experts per token)."
    paper = "Zhou et al., Mixture-of-Experts with Expert Choice Routing, NeurIPS 2022. arXiv:2202.09368"
    card = "cards/expert-choice.md"
    space = "router-explorer"

    @classmethod
    def demo_controls(cls, model=None):
        return [Control("capacity_factor", "float", None, low=0.25, high=float(layer_experts(model) or 8), step=0.25,
                        optional=True, help="experts per token on average (empty: the layer's k)")]

    @classmethod
    def demo_presets(cls, model=None):
        return {"mild": {}, "strong": {"capacity_factor": 1.0}}

    def __init__(self, hidden_size, num_experts, top_k, capacity_factor: float | None = None, **options):
        if capacity_factor is not None and (isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (
                int, float)) or not 0 < capacity_factor < math.inf):
            raise ValueError(f"capacity_factor must be a number > 0 (or None for the layer's top_k), "
                             f"got {capacity_factor!r}")
        super().__init__(hidden_size, num_experts, top_k, capacity_factor=capacity_factor, **options)
        # None: the layer's k, so the average compute per token matches the top-k router it replaces.
        self.capacity_factor = float(self.top_k if capacity_factor is None else capacity_factor)

    def capacity(self, tokens: int) -> int:
        """Tokens each expert takes from a batch of ``tokens``: ceil(T * factor / E), within [1, T]."""
        return max(1, min(tokens, math.ceil(tokens * self.capacity_factor / self.num_experts - 1e-9)))

    def forward(self, hidden: torch.Tensor) -> Routing:
        logits = self.gate_logits(hidden)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
        tokens = probs.shape[0]
        picked = probs.t().topk(self.capacity(tokens), dim=-1).indices  # [E, c] tokens each expert takes
        chosen = torch.zeros_like(probs.t(), dtype=torch.bool).scatter_(1, picked, True).t()  # [T, E]
        # Slot e of every token is expert e, or empty (index E) when expert e did not pick that token.
        experts = torch.arange(self.num_experts, device=probs.device).expand_as(chosen)
        indices = torch.where(chosen, experts, self.num_experts)
        weights = torch.where(chosen, probs, 0.0)  # the gate value itself, not renormalised (as in the paper)
        return Routing(weights=weights.to(hidden.dtype), indices=indices, logits=logits)
