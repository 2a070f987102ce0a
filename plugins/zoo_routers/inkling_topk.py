"""inkling-topk: Inkling's MoE router, which scores the block's routed and shared experts together.

One gate ``weight [E + S, H]`` gives each token a logit for each of the E routed experts and then for each of the
block's S shared experts (in fp32, autocast off). The k routed experts are picked by their sigmoid scores plus a
selection-only bias (``e_score_correction_bias [E]``). The k picked logits and the S shared logits are then weighed
against each other: each gets ``sigmoid(l) / sum of sigmoid(l')`` over those k + S (Inkling computes it as
``exp(logsigmoid(l) - logsumexp(logsigmoid))``), times ``route_scale`` and a learned scalar ``global_scale``. The
first k weights weigh the picked experts; the last S (``Routing.shared_weights``) weigh each shared expert for that
token, so a token whose picked experts score low leans on the shared experts, a sink in the normalisation.

The tensors are Inkling's own (``gate.weight``, ``gate.global_scale``, ``gate.e_score_correction_bias``), so a
converted model exports back unchanged. ``shared_experts=0``, for a block without them, leaves the normalised sigmoid
scores of the k picks."""
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from zoo.moe import Router, Routing


class InklingTopK(Router):
    name = "inkling-topk"
    summary = ("Inkling routing: sigmoid top-k with a selection-only bias; the picked experts and every shared expert "
               "weighted per token by their sigmoid scores normalised together, scaled.")
    card = "cards/inkling-topk.md"
    space = "router-explorer"
    demo_skip = Router.demo_skip + ("shared_experts",)  # a fact of the block: carried over from Inkling's router

    def __init__(self, hidden_size, num_experts, top_k, shared_experts: int = 0, route_scale: float = 1.0,
                 **options):
        if isinstance(shared_experts, bool) or not isinstance(shared_experts, int) or shared_experts < 0:
            raise ValueError(f"shared_experts must be a non-negative integer, got {shared_experts!r}")
        if isinstance(route_scale, bool) or not isinstance(route_scale, (int, float)) \
                or not 0 < route_scale < math.inf:
            raise ValueError(f"route_scale must be a positive finite number, got {route_scale!r}")
        super().__init__(hidden_size, num_experts, top_k, shared_experts=shared_experts,
                         route_scale=float(route_scale), **options)
        self.shared_rows, self.route_scale = shared_experts, float(route_scale)
        rows = num_experts + shared_experts  # the shared experts' rows after the routed experts'
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        nn.init.normal_(self.weight, std=0.02)
        self.bias = nn.Parameter(torch.zeros(rows)) if self.bias is not None else None
        self.global_scale = nn.Parameter(torch.ones(1))
        # a selection bias is updated outside backprop (aux-loss-free balancing): an fp32 buffer
        self.e_score_correction_bias = nn.Buffer(torch.zeros(num_experts, dtype=torch.float32))

    def init_weights(self, std: float) -> None:
        super().init_weights(std)  # as Inkling initialises its router
        init.ones_(self.global_scale)
        init.zeros_(self.e_score_correction_bias)

    def forward(self, hidden: torch.Tensor) -> Routing:
        E, k = self.num_experts, self.top_k
        dtype = torch.promote_types(hidden.dtype, torch.float32)  # fp32 (fp64 for a float64 check)
        with torch.autocast(hidden.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.to(dtype)
            logits = F.linear(hidden.to(dtype), self.weight.to(dtype), bias)
            routed, shared = logits[:, :E], logits[:, E:]
            choice = routed.sigmoid() + self.e_score_correction_bias.to(dtype)
            indices = choice.topk(k, dim=-1, sorted=False).indices
            picked = F.logsigmoid(torch.cat([routed.gather(1, indices), shared], dim=-1))
            weights = torch.exp(picked - picked.logsumexp(-1, keepdim=True))
            weights = weights * self.route_scale * self.global_scale.to(dtype)
        weights = weights.to(hidden.dtype)
        return Routing(weights=weights[:, :k], indices=indices, logits=routed,
                       shared_weights=weights[:, k:] if self.shared_rows else None)

    def reference(self, hidden: torch.Tensor, context=None) -> Routing:
        """Token by token, expert by expert."""
        E, k = self.num_experts, self.top_k
        rows = {"weights": [], "indices": [], "logits": [], "shared_weights": []}
        for x in hidden:
            logits = torch.stack([(self.weight[e] * x).sum() + (0 if self.bias is None else self.bias[e])
                                  for e in range(E + self.shared_rows)])
            choice = [1 / (1 + torch.exp(-logits[e])) + self.e_score_correction_bias[e] for e in range(E)]
            order = sorted(range(E), key=lambda e: -choice[e].item())[:k]
            scores = torch.stack([1 / (1 + torch.exp(-logits[e])) for e in order + list(range(E, len(logits)))])
            weights = scores / scores.sum() * self.route_scale * self.global_scale[0]
            rows["weights"].append(weights[:k])
            rows["indices"].append(torch.tensor(order, device=hidden.device))
            rows["logits"].append(logits[:E])
            rows["shared_weights"].append(weights[k:])
        out = {name: torch.stack(r) for name, r in rows.items()}
        return Routing(weights=out["weights"].to(hidden.dtype), indices=out["indices"], logits=out["logits"],
                       shared_weights=out["shared_weights"].to(hidden.dtype) if self.shared_rows else None)
