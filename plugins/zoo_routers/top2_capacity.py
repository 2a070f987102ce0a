"""top2-capacity: NLLB-MoE's router. Softmax over the expert logits in float32; each token's most probable expert
and, among the others, its highest-logit one. Over all the tokens of the block's call, an expert takes at most
``capacity`` first choices plus second choices (first choices claim their places first); a choice past it is an
empty slot. The two kept weights are renormalised to sum to 1 (after dropping, or before it with
``normalize_before_dropping``).

Capacity at inference: ``ceil(eval_capacity_fraction * T)`` for ``T`` tokens when the fraction is positive, else
``expert_capacity`` (None: ``2 * ceil(T / E)``); in training always the latter. ``batch_prioritized`` lets the
tokens with the most confident first choice take their places first. Padding tokens (0 in the routing
context's attention mask, when it lines up with the block's rows) get no expert unless ``route_padding``.
``token_dropout``: at inference the expert outputs are scaled by ``1 - p`` (folded into the
weights); in training each kept slot is dropped with probability ``p`` and the others scaled by ``1 / (1 - p)``."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from zoo.components.controls import controls_from_signature
from zoo.moe import Router, Routing, context


class Top2Capacity(Router):
    name = "top2-capacity"
    summary = ("NLLB-MoE's top-2 router: float32 softmax, the best expert and the best other one, an expert "
               "capacity over the whole batch, kept weights renormalised; padding tokens route nowhere.")
    card = "cards/top2-capacity.md"
    space = "router-explorer"

    @classmethod
    def demo_controls(cls, model=None):
        return controls_from_signature(cls, (*cls.demo_skip, "top_k"), model)  # k is always 2

    def __init__(self, hidden_size, num_experts, top_k: int = 2, expert_capacity: int | None = None,
                 eval_capacity_fraction: float = 1.0, normalize_before_dropping: bool = False,
                 batch_prioritized: bool = False, route_padding: bool = False, token_dropout: float = 0.0,
                 **options):
        """expert_capacity: choices one expert takes per call in training, and at inference when
        eval_capacity_fraction is not positive (None: 2 * ceil(tokens / experts)).
        eval_capacity_fraction: at inference, capacity = ceil(fraction * tokens) when positive.
        normalize_before_dropping: renormalise the two weights before the capacity drops choices.
        batch_prioritized: tokens claim places in order of their first choice's probability, highest first.
        route_padding: route padding tokens too (False: a padding token gets no expert).
        token_dropout: dropout on the expert outputs; at inference they are scaled by 1 - token_dropout."""
        if top_k != 2:
            raise ValueError(f"top2-capacity routes each token to two experts: top_k must be 2, got {top_k!r}")
        if num_experts < 2:
            raise ValueError(f"top2-capacity needs at least 2 experts, got {num_experts!r}")
        if expert_capacity is not None and (isinstance(expert_capacity, bool) or not isinstance(expert_capacity, int)
                                            or expert_capacity < 1):
            raise ValueError(f"expert_capacity must be a positive integer (or None), got {expert_capacity!r}")
        for key, value in (("eval_capacity_fraction", eval_capacity_fraction), ("token_dropout", token_dropout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise ValueError(f"{key} must be a number, got {value!r}")
        if not 0 <= token_dropout < 1:
            raise ValueError(f"token_dropout must be in [0, 1), got {token_dropout!r}")
        for key, value in (("normalize_before_dropping", normalize_before_dropping),
                           ("batch_prioritized", batch_prioritized), ("route_padding", route_padding)):
            if not isinstance(value, bool):
                raise ValueError(f"{key} must be True or False, got {value!r}")
        super().__init__(hidden_size, num_experts, top_k, expert_capacity=expert_capacity,
                         eval_capacity_fraction=float(eval_capacity_fraction),
                         normalize_before_dropping=normalize_before_dropping, batch_prioritized=batch_prioritized,
                         route_padding=route_padding, token_dropout=float(token_dropout), **options)
        self.expert_capacity, self.eval_capacity_fraction = expert_capacity, float(eval_capacity_fraction)
        self.normalize_before_dropping, self.batch_prioritized = normalize_before_dropping, batch_prioritized
        self.route_padding, self.token_dropout = route_padding, float(token_dropout)

    def capacity(self, tokens: int) -> int:
        if not self.training and self.eval_capacity_fraction > 0:
            return math.ceil(self.eval_capacity_fraction * tokens)
        return self.expert_capacity if self.expert_capacity is not None else 2 * math.ceil(tokens / self.num_experts)

    def forward(self, hidden: torch.Tensor) -> Routing:
        E, tokens = self.num_experts, hidden.shape[0]
        logits = F.linear(hidden.float(), self.weight.float(), None if self.bias is None else self.bias.float())
        probs = F.softmax(logits, dim=-1, dtype=torch.float32).to(hidden.dtype)
        first = probs.argmax(-1)
        second = logits.masked_fill(F.one_hot(first, E).bool(), float("-inf")).argmax(-1)
        p1, p2 = probs.gather(1, first[:, None])[:, 0], probs.gather(1, second[:, None])[:, 0]
        if self.normalize_before_dropping:
            p1, p2 = normalized(p1, p2)
        mask1, mask2 = F.one_hot(first, E), F.one_hot(second, E)
        real = None if self.route_padding else real_tokens(tokens, hidden.device)
        if real is not None:  # padding claims no place
            mask1, mask2 = mask1 * real[:, None], mask2 * real[:, None]
        order = (-probs.max(-1).values).argsort(dim=0) if self.batch_prioritized else None
        place1 = places(mask1, order)
        place2 = places(mask2, order) + mask1.sum(0, keepdim=True)  # second choices queue after all first ones
        capacity = self.capacity(tokens)
        keep1 = (mask1 * (place1 < capacity)).sum(-1).bool()
        keep2 = (mask2 * (place2 < capacity)).sum(-1).bool()
        if not self.normalize_before_dropping:
            p1, p2 = normalized(p1 * keep1, p2 * keep2)
        weights = torch.stack([p1 * keep1, p2 * keep2], -1)
        if self.token_dropout > 0:
            if self.training:
                weights = F.dropout(weights, self.token_dropout)
            else:
                weights = weights * (1 - self.token_dropout)
        indices = torch.stack([first.masked_fill(~keep1, E), second.masked_fill(~keep2, E)], -1)
        return Routing(weights=weights, indices=indices, logits=logits)


def normalized(p1: torch.Tensor, p2: torch.Tensor):
    total = (p1 + p2).clamp(min=torch.finfo(p1.dtype).eps)
    return p1 / total, p2 / total


def places(mask: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """``[T, E]``: each chosen (token, expert) pair's place in its expert's queue, in token order or ``order``."""
    if order is None:
        return mask.cumsum(0) - 1
    ranked = mask[order]
    return ((ranked.cumsum(0) - 1) * ranked)[order.argsort(dim=0)]


def real_tokens(tokens: int, device) -> torch.Tensor | None:
    """``[T]`` True for a real token, from the routing context's attention mask when it lines up with the rows."""
    ctx = context.current()
    mask = None if ctx is None else ctx.attention_mask
    if mask is None or mask.numel() != tokens:
        return None
    return mask.reshape(-1).to(device).bool()
