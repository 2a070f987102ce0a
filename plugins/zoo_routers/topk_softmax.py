"""topk-softmax: softmax over expert logits, keep the k largest, optionally renormalise."""
import math

import torch
import torch.nn.functional as F

from zoo.moe import Router, Routing
from zoo.components.controls import Control


class TopKSoftmax(Router):
    name = "topk-softmax"
    summary = "Softmax over expert logits, keep top-k, optionally renormalise (Mixtral, Qwen-MoE, OLMoE, GPT-OSS)."
    paper = ("Jiang et al., Mixtral of Experts, 2024, arXiv:2401.04088; Fedus et al., Switch Transformers, "
             "2021, arXiv:2101.03961 (balance loss)")
    card = "cards/topk-softmax.md"
    space = "router-explorer"

    @classmethod
    def demo_controls(cls, model=None):
        return [*super().demo_controls(model)[:1],
                Control("norm_topk_prob", "bool", True, help="renormalise the kept weights to sum to 1")]

    def __init__(self, hidden_size, num_experts, top_k, norm_topk_prob: bool = True, norm_p: float = 1.0,
                 **options):
        # norm_p: renormalise by the kept weights' p-norm instead of their sum (DBRX's moe_normalize_expert_weights);
        # recorded only when it is not 1, so layouts that renormalise by the sum stay as they were
        if isinstance(norm_p, bool) or not isinstance(norm_p, (int, float)) or not math.isfinite(norm_p) or norm_p <= 0:
            raise ValueError(f"norm_p must be a finite number > 0, got {norm_p!r}")
        if norm_p != 1 and not norm_topk_prob:
            raise ValueError(f"norm_p={norm_p} renormalises the kept weights: it needs norm_topk_prob=True")
        extra = {"norm_p": float(norm_p)} if norm_p != 1 else {}
        super().__init__(hidden_size, num_experts, top_k, norm_topk_prob=bool(norm_topk_prob), **extra, **options)
        self.norm_topk_prob, self.norm_p = bool(norm_topk_prob), float(norm_p)

    def forward(self, hidden: torch.Tensor) -> Routing:
        logits = self.gate_logits(hidden)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, indices = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob and self.norm_p != 1:
            weights = weights / torch.linalg.vector_norm(weights, ord=self.norm_p, dim=-1, keepdim=True)
        elif self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(weights=weights.to(hidden.dtype), indices=indices, logits=logits)
