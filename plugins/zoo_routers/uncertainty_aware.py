"""uncertainty-aware: MoFME's Uncertainty-aware Router (Zhang et al., AAAI 2024, arXiv:2312.16610).

A plain linear router is over-confident: its softmax is one point estimate. The uncertainty-aware router treats
its gate as Bayesian through Monte Carlo dropout: ``samples`` passes of the gate over dropout-masked inputs give
``samples`` softmax distributions over the experts; their mean is the calibrated routing distribution (top-k is
taken from it, weights renormalised), their standard deviation the router's uncertainty per expert
(``uncertainty()``). Where the samples disagree, the mean spreads its weight instead of trusting one
over-confident pass: the calibrated assignment of features to the FiLM experts.

Training runs the MC passes (the gradient flows through all of them). Inference, by default, runs the gate once
without dropout (the usual deterministic approximation of the MC mean: same weights, no randomness, so a saved
model reloads to the same logits and the decode path stays compile-friendly); ``mc_inference=True`` keeps the
MC passes at inference, as a Bayesian router would. The returned ``logits`` are the log of the calibrated
probabilities when MC runs, so the load-balancing loss reads the same distribution the routing used.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from zoo.components.controls import Control
from zoo.moe import Router, Routing
from zoo.components.options import check_float, check_int

PAPER = ("Zhang et al., Efficient Deweather Mixture-of-Experts with Uncertainty-aware Feature-wise Linear "
         "Modulation, AAAI 2024, arXiv:2312.16610")
TINY = 1e-20  # floor for log(probabilities): an expert with probability 0 in every sample


class UncertaintyAware(Router):
    name = "uncertainty-aware"
    summary = ("MoFME's uncertainty-aware router: top-k over the mean of Monte Carlo dropout samples of the gate's "
               "softmax (calibrated weights); their spread is the routing uncertainty.")
    paper = PAPER
    card = "cards/uncertainty-aware.md"
    space = "router-explorer"

    @classmethod
    def demo_controls(cls, model=None):
        return [*super().demo_controls(model)[:1],
                Control("samples", "int", 4, low=1, high=16, step=1, help="Monte Carlo dropout passes of the gate"),
                Control("dropout", "float", 0.1, low=0.0, high=0.5, step=0.05, help="dropout on the gate's input"),
                Control("mc_inference", "bool", False, help="keep the MC passes at inference (random weights)")]

    def __init__(self, hidden_size, num_experts, top_k, samples: int = 4, dropout: float = 0.1,
                 norm_topk_prob: bool = True, mc_inference: bool = False, **options):
        samples = check_int("samples", samples, 1, 64)
        dropout = check_float("dropout", dropout, 0.0, 0.9)
        super().__init__(hidden_size, num_experts, top_k, samples=samples, dropout=dropout,
                         norm_topk_prob=bool(norm_topk_prob), mc_inference=bool(mc_inference), **options)
        self.samples, self.dropout = samples, dropout
        self.norm_topk_prob, self.mc_inference = bool(norm_topk_prob), bool(mc_inference)

    def uses_mc(self) -> bool:
        return self.dropout > 0 and (self.training or self.mc_inference)

    def masks(self, tokens: int, like: torch.Tensor) -> torch.Tensor:
        """[S, T, H] inverted-dropout masks (kept inputs scaled by 1/(1-p)), from torch's global generator."""
        keep = 1.0 - self.dropout
        shape = (self.samples, tokens, self.hidden_size)
        return torch.empty(shape, device=like.device, dtype=like.dtype).bernoulli_(keep) / keep

    def sampled_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, T, E] softmax of the gate over S dropout-masked copies of the input."""
        logits = F.linear(hidden.unsqueeze(0) * self.masks(hidden.shape[0], hidden), self.weight, self.bias)
        return F.softmax(logits, dim=-1, dtype=torch.float32)

    def forward(self, hidden: torch.Tensor) -> Routing:
        if self.uses_mc():
            probs = self.sampled_probs(hidden).mean(0)
            logits = probs.clamp(min=TINY).log()
        else:
            logits = self.gate_logits(hidden)
            probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, indices = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(weights=weights.to(hidden.dtype), indices=indices, logits=logits)

    @torch.no_grad()
    def uncertainty(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean [T, E], std [T, E]) of the MC samples' routing probabilities, whatever the mode (needs dropout > 0
        for a spread)."""
        probs = self.sampled_probs(hidden)
        return probs.mean(0), probs.std(0, unbiased=False)

    def reference(self, hidden: torch.Tensor, context=None) -> Routing:
        """One token at a time: the same masks (drawn first, as ``forward`` draws them), each sample's softmax
        written out, averaged; experts ranked by sorting."""
        mc = self.uses_mc()
        masks = self.masks(hidden.shape[0], hidden) if mc else None
        weights, indices, logits = [], [], []
        for t in range(hidden.shape[0]):
            if mc:
                rows = []
                for s in range(self.samples):
                    z = self.weight @ (hidden[t] * masks[s, t]) + (0 if self.bias is None else self.bias)
                    e = torch.exp(z.float() - z.float().max())
                    rows.append(e / e.sum())
                p = torch.stack(rows).sum(0) / self.samples
                logit = p.clamp(min=TINY).log()
            else:
                logit = self.weight @ hidden[t] + (0 if self.bias is None else self.bias)
                e = torch.exp(logit.float() - logit.float().max())
                p = e / e.sum()
            order = torch.sort(p, descending=True).indices[: self.top_k]
            w = p[order]
            weights.append(w / w.sum() if self.norm_topk_prob else w)
            indices.append(order)
            logits.append(logit)
        return Routing(weights=torch.stack(weights).to(hidden.dtype), indices=torch.stack(indices),
                       logits=torch.stack(logits))
