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


def family_aux_loss(family, router_logits, blocks, attention_mask=None) -> torch.Tensor:
    """A zoo model's balance loss, in its family's own definition.

    When every MoE layer has the same expert count and k (a converted model, or one pruned uniformly) this is
    the family's native ``load_balancing_loss_func``: top-k counts and router probabilities pooled over all
    layers' tokens, ``E * sum_e f_e P_e`` with ``f_e`` the share of tokens (not slots) choosing e, so uniform
    routing gives k. Where layers differ, pooling is undefined; the loss is then the mean over layers of the
    same per-layer quantity (k times ``load_balancing_loss``)."""
    import sys

    shapes = {(moe.router.num_experts, moe.top_k) for moe in blocks}  # the logits' width (an expert map keeps E rows)
    native = getattr(sys.modules[family.model_class.__module__], "load_balancing_loss_func", None)
    if len(shapes) == 1 and native is not None:
        (num_experts, top_k), = shapes
        return native(tuple(router_logits), num_experts, top_k, attention_mask)
    losses = [moe.top_k * load_balancing_loss(lg, moe.top_k, attention_mask) for lg, moe in zip(router_logits, blocks)]
    return torch.stack(losses).mean()
