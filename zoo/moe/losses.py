"""Auxiliary MoE losses as plain functions. Padding tokens (attention_mask == 0) never count."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _token_mask(logits: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    if attention_mask is None:
        return torch.ones(logits.shape[0], dtype=logits.dtype, device=logits.device)
    mask = attention_mask.reshape(-1).to(logits.device, logits.dtype)
    if mask.numel() != logits.shape[0]:
        raise ValueError(f"attention_mask has {mask.numel()} tokens, router logits {logits.shape[0]}")
    return mask


def load_balancing_loss(logits: torch.Tensor, top_k: int, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Switch Transformers balance loss for one layer: ``E * sum_e f_e * P_e``.

    ``f_e`` is the fraction of routed (token, slot) pairs sent to expert e by top-k selection, ``P_e`` the
    mean router probability of e, both over non-padding tokens. Equals 1 for perfectly uniform routing.
    """
    logits = logits.float()
    num_experts = logits.shape[-1]
    mask = _token_mask(logits, attention_mask)
    logits = logits.masked_fill(mask[:, None] == 0, 0.0)  # padding must not leak NaN/inf into the sums
    probs = F.softmax(logits, dim=-1)
    chosen = F.one_hot(probs.topk(top_k, dim=-1).indices, num_experts).sum(1).float()  # [T, E]
    denom = mask.sum().clamp(min=1)
    f = (chosen * mask[:, None]).sum(0) / (denom * top_k)
    p = (probs * mask[:, None]).sum(0) / denom
    return num_experts * (f * p).sum()


def z_loss(logits: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """ST-MoE router z-loss: mean over non-padding tokens of logsumexp(logits)^2."""
    logits = logits.float()
    mask = _token_mask(logits, attention_mask)
    logits = logits.masked_fill(mask[:, None] == 0, 0.0)
    return (torch.logsumexp(logits, dim=-1).pow(2) * mask).sum() / mask.sum().clamp(min=1)


def model_load_balancing_loss(router_logits, top_ks, attention_mask=None) -> torch.Tensor:
    """Mean of the per-layer balance losses (layers may differ in expert count and k)."""
    losses = [load_balancing_loss(lg, k, attention_mask) for lg, k in zip(router_logits, top_ks)]
    return torch.stack(losses).mean()
