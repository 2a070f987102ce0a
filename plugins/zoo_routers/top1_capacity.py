"""top1-capacity: Switch Transformers' router. Softmax over the expert logits in float32, each token to its most
probable expert, weighted by that probability; per sequence, an expert takes at most ``expert_capacity`` tokens,
in order, and a token past its expert's capacity skips the layer (an empty slot: the residual carries it).

The sequences are those of the model call the block runs in: the routing context's ``[B, S]`` shape (a zoo
Switch Transformers model publishes one per encoder and decoder call), so capacity is counted per row exactly as
the family counts it. Outside a model call (no context) every row of the block's input is one sequence."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from zoo.components.controls import controls_from_signature
from zoo.moe import Router, Routing, context


class Top1Capacity(Router):
    name = "top1-capacity"
    summary = ("Switch Transformers' top-1 router: float32 softmax, each token to its most probable expert with "
               "that weight; tokens past an expert's per-sequence capacity skip the layer.")
    card = "cards/top1-capacity.md"
    space = "router-explorer"

    @classmethod
    def demo_controls(cls, model=None):
        return controls_from_signature(cls, (*cls.demo_skip, "top_k"), model)  # k is always 1

    def __init__(self, hidden_size, num_experts, top_k: int = 1, expert_capacity: int | None = None,
                 jitter_noise: float = 0.0, **options):
        """expert_capacity: tokens of one sequence each expert takes at most (None: no limit).
        jitter_noise: in training, each hidden value is scaled by a factor drawn from [1 - j, 1 + j] before routing."""
        if top_k != 1:
            raise ValueError(f"top1-capacity routes each token to one expert: top_k must be 1, got {top_k!r}")
        if expert_capacity is not None and (isinstance(expert_capacity, bool) or not isinstance(expert_capacity, int)
                                            or expert_capacity < 1):
            raise ValueError(f"expert_capacity must be a positive integer (or None: no limit), got {expert_capacity!r}")
        if isinstance(jitter_noise, bool) or not isinstance(jitter_noise, (int, float)) or not 0 <= jitter_noise < 1:
            raise ValueError(f"jitter_noise must be a number in [0, 1), got {jitter_noise!r}")
        super().__init__(hidden_size, num_experts, top_k, expert_capacity=expert_capacity,
                         jitter_noise=float(jitter_noise), **options)
        self.expert_capacity, self.jitter_noise = expert_capacity, float(jitter_noise)

    def forward(self, hidden: torch.Tensor) -> Routing:
        x = hidden.float()
        if self.training and self.jitter_noise > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        logits = F.linear(x, self.weight.float(), None if self.bias is None else self.bias.float())
        # the family picks on the probabilities cast back to the input's dtype (ties there go to the lower index)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32).to(hidden.dtype)
        weights, indices = probs.max(dim=-1)
        if self.expert_capacity is not None:
            indices = self.drop_over_capacity(indices)
        return Routing(weights=weights[:, None], indices=indices[:, None], logits=logits)

    def drop_over_capacity(self, indices: torch.Tensor) -> torch.Tensor:
        """``indices [T]`` with each token past its expert's capacity in its sequence set to the empty slot E."""
        tokens = indices.shape[0]
        rows = sequence_rows(tokens)
        taken = F.one_hot(indices, self.num_experts).view(tokens // rows, rows, self.num_experts).cumsum(1)
        order = taken.view(tokens, self.num_experts).gather(1, indices[:, None])[:, 0]  # 1 for an expert's first
        return indices.masked_fill(order > self.expert_capacity, self.num_experts)


def sequence_rows(tokens: int) -> int:
    """How many consecutive rows of the block's input form one sequence: S of the call's ``[B, S]`` routing
    context, or all ``tokens`` rows outside a model call."""
    ctx = context.current()
    shape = next((v.shape for v in (ctx.positions, ctx.input_ids, ctx.attention_mask) if v is not None), None) \
        if ctx is not None else None
    if shape is None:
        return tokens
    if len(shape) != 2 or shape[0] * shape[1] != tokens:
        raise ValueError(f"the routing context holds {tuple(shape)} tokens for {tokens} hidden rows: top1-capacity "
                         "counts capacity per sequence and cannot tell this block's sequences apart")
    return shape[1]
