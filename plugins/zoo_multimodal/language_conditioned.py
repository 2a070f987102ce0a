"""language-conditioned: Parrot's text-guided selection of the experts that transform visual tokens.

Per image, the mean visual feature queries the text embedding by single-head cross-attention,
``c = softmax(q K^T / sqrt(H)) V`` with ``q = W_q mean(v)``, ``K = W_k t``, ``V = W_v t``; the router
scores experts from ``c`` (``weight [E, H]``) and all of the image's visual tokens share its top-k experts.
The text comes from the routing context (``zoo.moe.RoutingContext``: ``prompt_embeds [B, L, C]`` and
``prompt_mask [B, L]``), which the model publishes around the block (the hidden rows are then the B images'
P visual tokens, image-major). Without a prompt in the context each token routes itself (plain top-k softmax).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from zoo.moe import Router, Routing, RoutingContext


class LanguageConditioned(Router):
    name = "language-conditioned"
    summary = "Parrot: cross-attention of visual features over the text embedding picks the visual experts."
    paper = ("Sun et al., Parrot: Multilingual Visual Instruction Tuning, ICML 2025, arXiv:2406.02539")
    card = "cards/language-conditioned.md"
    space = "multimodal-digits"
    uses_context = True

    @classmethod
    def demo_controls(cls, model=None):
        return super().demo_controls(model)[:1]  # context_size is the model's text width

    @classmethod
    def demo_unfit(cls, model):
        if model.config.model_type == "zoo_mm":
            return ""
        return ("language-conditioned routes an image's visual tokens by the text prompt, read from the routing "
                "context that a multimodal model (zoo_mm) publishes around its vision MoE block. This "
                f"{model.config.model_type} model has no images and no prompt context: every token would route "
                "itself by plain top-k softmax, so it is not shown here (see the multimodal-digits Space).")

    def __init__(self, hidden_size, num_experts, top_k, context_size: int | None = None, **options):
        context_size = int(context_size or hidden_size)
        super().__init__(hidden_size, num_experts, top_k, context_size=context_size, **options)
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(context_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(context_size, hidden_size, bias=False)

    def attend(self, visual: torch.Tensor, text: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``visual [B, P, H]`` over ``text [B, L, C]`` (0/1 ``mask [B, L]``) -> the router input ``[B, H]``."""
        q = self.q_proj(visual.mean(1))  # [B, H]
        scores = torch.einsum("bh,blh->bl", q, self.k_proj(text)) / math.sqrt(self.hidden_size)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, float("-inf"))
        return torch.einsum("bl,blh->bh", scores.softmax(-1), self.v_proj(text))

    def forward(self, hidden: torch.Tensor, context: RoutingContext | None = None) -> Routing:
        text = None if context is None else context.prompt_embeds
        if text is None:
            logits = self.gate_logits(hidden)
        else:
            batch = text.shape[0]
            per_image = hidden.shape[0] // batch
            logits = self.gate_logits(self.attend(hidden.view(batch, per_image, -1), text, context.prompt_mask))
            logits = logits.repeat_interleave(per_image, dim=0)  # [T, E]: an image's tokens share its routing
        weights, indices = logits.float().softmax(-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return Routing(weights=weights.to(hidden.dtype), indices=indices, logits=logits)
