"""gemma4-topk: Gemma 4's MoE router. The router reads its own RMS-normed copy of the block input (no weight),
scaled per channel by ``scale [H]`` and by H**-0.5; then softmax over the gate logits, the k most probable experts
kept, their weights renormalised to sum to 1 and each multiplied by its expert's ``per_expert_scale [E]``.

The tensors are Gemma 4's own (``router.proj.weight`` is ``weight``), so a converted model exports back unchanged.
The RMS norm is computed in float32 and cast back, then scaled in the input's dtype, as Gemma 4 computes it."""
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from zoo.moe import Router, Routing


class Gemma4TopK(Router):
    name = "gemma4-topk"
    summary = ("Gemma 4 routing: softmax top-k over the gate logits of an RMS-normed, per-channel scaled input; "
               "kept weights renormalised and scaled per expert.")
    card = "cards/gemma4-topk.md"
    space = "router-explorer"

    def __init__(self, hidden_size, num_experts, top_k, eps: float = 1e-6, **options):
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
            raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
        super().__init__(hidden_size, num_experts, top_k, eps=float(eps), **options)
        self.eps = float(eps)
        self.scale = nn.Parameter(torch.ones(hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))

    def init_weights(self, std: float) -> None:
        super().init_weights(std)
        init.ones_(self.scale)  # as Gemma 4 initialises its router
        init.ones_(self.per_expert_scale)

    def normed_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the gate reads: ``rms_norm(hidden) * scale * H**-0.5``."""
        h = hidden.float()
        h = (h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)).to(hidden.dtype)
        return h * self.scale * self.hidden_size ** -0.5

    def forward(self, hidden: torch.Tensor) -> Routing:
        logits = self.gate_logits(self.normed_input(hidden))
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, indices = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights * self.per_expert_scale[indices]
        return Routing(weights=weights.to(hidden.dtype), indices=indices, logits=logits)

    def reference(self, hidden: torch.Tensor, context=None) -> Routing:
        """Token by token, expert by expert."""
        rows_w, rows_i, rows_l = [], [], []
        for x in hidden:
            rms = (x.float().pow(2).mean() + self.eps) ** -0.5
            read = (x.float() * rms).to(hidden.dtype) * self.scale * self.hidden_size ** -0.5
            logits = torch.stack([(self.weight[e] * read).sum() + (0 if self.bias is None else self.bias[e])
                                  for e in range(self.num_experts)])
            probs = torch.exp(logits.float() - logits.float().max())
            probs = probs / probs.sum()
            order = sorted(range(self.num_experts), key=lambda e: -probs[e].item())[:self.top_k]
            kept = torch.stack([probs[e] for e in order])
            kept = kept / kept.sum() * torch.stack([self.per_expert_scale[e] for e in order])
            rows_w.append(kept)
            rows_i.append(torch.tensor(order, device=hidden.device))
            rows_l.append(logits)
        return Routing(torch.stack(rows_w).to(hidden.dtype), torch.stack(rows_i), torch.stack(rows_l))
