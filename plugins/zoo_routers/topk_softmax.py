"""topk-softmax: softmax over expert logits, keep the k largest, optionally renormalise."""
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

    def __init__(self, hidden_size, num_experts, top_k, norm_topk_prob: bool = True, **options):
        super().__init__(hidden_size, num_experts, top_k, norm_topk_prob=bool(norm_topk_prob), **options)
        self.norm_topk_prob = bool(norm_topk_prob)

    def forward(self, hidden: torch.Tensor) -> Routing:
        logits = self.gate_logits(hidden)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, indices = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(weights=weights.to(hidden.dtype), indices=indices, logits=logits)
