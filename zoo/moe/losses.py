"""Auxiliary MoE losses as plain functions. Padding tokens (attention_mask == 0) never count."""
from __future__ import annotations

import functools

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


@functools.lru_cache(maxsize=None)
def native_balance_loss(model_class):
    """The balance-loss function a transformers family's forward calls (``load_balancing_loss_func(logits, E, k,
    attention_mask)`` of its modeling module), or None where its forward computes none."""
    import inspect
    import sys

    native = getattr(sys.modules[model_class.__module__], "load_balancing_loss_func", None)
    if native is None or "load_balancing_loss_func(" not in inspect.getsource(model_class.forward):
        return None
    return native


def family_aux_loss(native, router_logits, top_ks, attention_mask=None) -> torch.Tensor:
    """A model's balance loss in its family's own definition; ``native``: the family's loss function (see
    ``native_balance_loss``; None: the pooled form below), ``top_ks``: each logit matrix's k.

    When every recorded layer has the same expert count and k (a converted model, or one pruned uniformly) this is
    the family's own call: transformers' families pool top-k counts and router probabilities over all layers'
    tokens, ``E * sum_e f_e P_e`` with ``f_e`` the share of tokens (not slots) choosing e, so uniform routing gives
    k. Where layers differ, pooling is undefined (expert e of one layer is not expert e of another); the loss is
    then the mean over layers of the family's loss on each layer alone, over that layer's own experts."""
    logits, top_ks = tuple(router_logits), list(top_ks)
    if len(logits) != len(top_ks) or not logits:
        raise ValueError(f"{len(logits)} router logit matrices for {len(top_ks)} top-k values")
    shapes = {(lg.shape[-1], k) for lg, k in zip(logits, top_ks)}
    if native is None:
        native = _pooled_balance_loss
    if len(shapes) == 1:
        (num_experts, top_k), = shapes
        return native(logits, num_experts, top_k, attention_mask)
    losses = [native((lg,), lg.shape[-1], k, attention_mask) for lg, k in zip(logits, top_ks)]
    return torch.stack([loss.to(losses[0].device) for loss in losses]).mean()


def slot_balance_loss(logits, num_experts, top_k, attention_mask=None) -> torch.Tensor:
    """All layers pooled with ``f_e`` the share of (token, slot) pairs choosing e, as Doge defines it (its own function
    reads the [2, T, n] sub-key logits; on the experts' summed scores it is this): uniform routing gives 1."""
    pooled = torch.cat([lg.to(logits[0].device) for lg in logits])
    mask = None if attention_mask is None else attention_mask.reshape(-1).repeat(len(logits))
    return load_balancing_loss(pooled, top_k, mask)


def _pooled_balance_loss(logits, num_experts, top_k, attention_mask=None) -> torch.Tensor:
    """All layers pooled as transformers' families pool them: ``k * load_balancing_loss`` of the stacked tokens."""
    pooled = torch.cat([lg.to(logits[0].device) for lg in logits])
    mask = None if attention_mask is None else attention_mask.reshape(-1).repeat(len(logits))
    return top_k * load_balancing_loss(pooled, top_k, mask)
