"""otp: MC#'s online top-any pruning. A small learned pruner sits on top of the model's own top-k softmax routing
and, per token, drops experts from the top-k set (it only removes, never adds).

Per token: ``probs = softmax(gate logits)``, the top-k experts (most probable first) and their weights ``w``
(renormalised over the k when ``norm_topk_prob``, as the base router). The pruner is one linear map of
``[hidden, w]`` (H + k features) to k keep-logits ``l``, one per ranked slot; the first slot (the most probable
expert) is always kept, so a token never loses all its experts. Kept weights are renormalised over the kept set
when ``norm_topk_prob`` (otherwise a dropped expert's share is simply gone).

- training (``router.train()``): each prunable slot draws a keep/drop decision from a two-class Gumbel-softmax
  (binary concrete: ``sigmoid((l + logistic noise) / temperature)``), hard in the forward pass and soft in the
  backward (straight-through). Every top-k expert is still computed (a dropped one with weight 0) so that the
  gradient can reach a dropped slot. ``sparsity_loss`` (the mean keep probability ``sigmoid(l)`` of the
  prunable slots) times ``sparsity`` is the router's ``train_loss()``, which ``moe-zoo finetune`` adds to the
  language-model loss; only the pruner trains (``trainable_parameters``), the model and its gate stay frozen.
- inference (``router.eval()``): deterministic, a slot is kept when ``sigmoid(l) >= keep_threshold`` (0.5: the
  argmax of the two classes); a dropped slot becomes the empty slot (index E), so its expert is not computed.

Initialisation (no trained pruner yet): the hidden-state part of the map is zero and slot j's logit is
``1 + 4 k w_j``, so at ``keep_threshold=0.5`` every top-k expert is kept (exactly the base routing) and a higher
threshold drops the low-weight slots first (an untrained, weight-ratio prior; training replaces it).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from zoo.components.controls import Control
from zoo.moe import Router, Routing
from zoo.components.options import check_float

INIT_BIAS, INIT_SLOPE = 1.0, 4.0  # keep-logit of slot j at initialisation: INIT_BIAS + INIT_SLOPE * k * w_j


class OnlineTopAnyPruning(Router):
    name = "otp"
    summary = ("MC# online top-any pruning: a learned Gumbel-softmax pruner drops experts from each token's "
               "top-k set (trained with moe-zoo finetune; deterministic at inference).")
    paper = ("Huang et al., MC#: Mixture Compressor for Mixture-of-Experts Large Models, 2025, arXiv:2510.10962 "
             "(Online Top-any Pruning)")
    card = "cards/otp.md"
    space = "router-explorer"

    @classmethod
    def demo_controls(cls, model=None):
        top_k = super().demo_controls(model)[0]
        return [top_k.with_range(low=2),
                Control("keep_threshold", "float", 0.5, low=0.05, high=0.99, step=0.01,
                        help="keep a slot when the pruner's keep probability reaches this (0.5: the paper's argmax)")]

    @classmethod
    def demo_presets(cls, model=None):
        """An untrained pruner keeps every expert at 0.5: the presets raise the threshold, so the weight-ratio
        prior drops the weakest second experts (mild) or most of them (strong)."""
        mild = {c.name: c.default for c in cls.demo_controls(model)}
        return {"mild": {**mild, "keep_threshold": 0.9}, "strong": {**mild, "keep_threshold": 0.97}}

    def __init__(self, hidden_size, num_experts, top_k, keep_threshold: float = 0.5, temperature: float = 1.0,
                 sparsity: float = 0.1, norm_topk_prob: bool = True, **options):
        keep_threshold = check_float("keep_threshold", keep_threshold, 0.0, 1.0)
        if not 0.0 < keep_threshold < 1.0:
            raise ValueError(f"keep_threshold must be a probability in (0, 1), got {keep_threshold!r}")
        temperature = check_float("temperature", temperature, 1e-3)
        sparsity = check_float("sparsity", sparsity, 0.0)
        if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k < 2:
            raise ValueError(f"otp prunes inside the top-k set and always keeps the first expert: it needs top_k >= 2, "
                             f"got top_k={top_k}")
        super().__init__(hidden_size, num_experts, top_k, keep_threshold=keep_threshold, temperature=temperature,
                         sparsity=sparsity, norm_topk_prob=bool(norm_topk_prob), **options)
        self.keep_threshold, self.temperature, self.sparsity = keep_threshold, temperature, sparsity
        self.norm_topk_prob = bool(norm_topk_prob)
        k = self.top_k
        self.prune_weight = nn.Parameter(torch.empty(k, hidden_size + k))
        self.prune_bias = nn.Parameter(torch.empty(k))
        self.reset_pruner()
        self.sparsity_loss: torch.Tensor | None = None  # mean keep probability of the last training forward
        # built in eval mode: zoo.apply swaps it into a model that may already be in eval mode, which would not
        # reach it, and a deterministic router is the safe default; model.train() (finetune) turns sampling on
        self.train(False)

    @torch.no_grad()
    def reset_pruner(self) -> None:
        """The initial pruner: keep-logit ``INIT_BIAS + INIT_SLOPE * k * w_j`` of slot j."""
        k = self.top_k
        self.prune_weight.zero_()
        self.prune_weight[:, self.hidden_size:] = torch.eye(k) * INIT_SLOPE * k
        self.prune_bias.fill_(INIT_BIAS)

    def init_weights(self, std: float) -> None:
        super().init_weights(std)
        k = self.top_k
        weight = torch.zeros(k, self.hidden_size + k)
        weight[:, self.hidden_size:] = torch.eye(k) * INIT_SLOPE * k
        init.copy_(self.prune_weight, weight)  # only if the load left them missing
        init.constant_(self.prune_bias, INIT_BIAS)

    # ---------------------------------------------------------------------------------------------- training
    def trainable_parameters(self) -> list[nn.Parameter]:
        """What ``moe-zoo finetune`` trains: the pruner only (the gate and the experts stay frozen)."""
        return [self.prune_weight, self.prune_bias]

    def train_loss(self) -> torch.Tensor | None:
        """``sparsity`` x the mean keep probability of the prunable slots in the last training forward."""
        return None if self.sparsity_loss is None else self.sparsity * self.sparsity_loss

    # ----------------------------------------------------------------------------------------------- routing
    def top_k_weights(self, logits: torch.Tensor):
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        top, indices = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(-1, keepdim=True)
        return top, indices

    def keep_logits(self, hidden: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        """[T, k] keep-logit of each ranked slot from the token and its top-k weights."""
        features = torch.cat([hidden.float(), top], dim=-1)
        return F.linear(features, self.prune_weight.float(), self.prune_bias.float())

    def forward(self, hidden: torch.Tensor) -> Routing:
        logits = self.gate_logits(hidden)
        top, indices = self.top_k_weights(logits)
        keep_logit = self.keep_logits(hidden, top)
        first = torch.zeros_like(keep_logit, dtype=torch.bool)
        first[:, 0] = True
        if self.training:
            u = torch.rand_like(keep_logit).clamp(1e-6, 1 - 1e-6)
            soft = torch.sigmoid((keep_logit + torch.log(u) - torch.log1p(-u)) / self.temperature)
            mask = (soft > 0.5).float() + soft - soft.detach()  # straight-through: hard forward, soft backward
            mask = torch.where(first, torch.ones_like(mask), mask)
            self.sparsity_loss = torch.sigmoid(keep_logit[:, 1:]).mean()
            weights = top * mask
            if self.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
            return Routing(weights=weights.to(hidden.dtype), indices=indices, logits=logits)
        self.sparsity_loss = None
        keep = (torch.sigmoid(keep_logit) >= self.keep_threshold) | first
        weights = torch.where(keep, top, 0.0)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return Routing(weights=weights.to(hidden.dtype), indices=torch.where(keep, indices, self.num_experts),
                       logits=logits)

    def reference(self, hidden: torch.Tensor) -> Routing:
        """Inference routing token by token, written out plainly."""
        E, k = self.num_experts, self.top_k
        logits = self.gate_logits(hidden)
        rows_w, rows_i = [], []
        for t in range(hidden.shape[0]):
            probs = torch.softmax(logits[t].float(), dim=-1)
            order = sorted(range(E), key=lambda e: (-probs[e].item(), e))[:k]
            w = torch.stack([probs[e] for e in order])
            if self.norm_topk_prob:
                w = w / w.sum()
            x = torch.cat([hidden[t].float(), w])
            kept_w, kept_i = [], []
            for j, e in enumerate(order):
                p_keep = torch.sigmoid((self.prune_weight[j].float() * x).sum() + self.prune_bias[j].float())
                if j == 0 or p_keep.item() >= self.keep_threshold:
                    kept_w.append(w[j])
                    kept_i.append(e)
            kept = torch.stack(kept_w)
            if self.norm_topk_prob:
                kept = kept / kept.sum()
            pad = k - len(kept_i)
            rows_w.append(torch.cat([kept, kept.new_zeros(pad)]))
            rows_i.append(torch.tensor(kept_i + [E] * pad))
        return Routing(weights=torch.stack(rows_w).to(hidden.dtype), indices=torch.stack(rows_i), logits=logits)
