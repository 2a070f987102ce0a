"""hierarchical-modality: MoHAVE's two-level routing over modality expert groups.

A group gate ``group_weight [G, H]`` scores the groups from the token itself and keeps the ``top_groups``
best (their softmax weights renormalised); inside each kept group the expert gate ``weight [E, H]`` keeps the
top ``top_k // top_groups`` experts (softmax within the group, renormalised). A slot's weight is
group weight x in-group weight. ``logits`` are the log-probabilities of the full two-level distribution,
``log p(group) + log p(expert | group)``, so the balance loss and statistics see one [T, E] distribution.
No host syncs at inference: every shape is fixed by the options (the training-only loss below checks which
modalities are present).

Group-load biasing (MoHAVE's training objective for the group gate): ``modalities`` binds each group to the
modality it serves ("text", "vision", "audio"). In training mode, with a routing context that tags each token's
modality, the router keeps ``group_load_loss``: for every modality m present among the real tokens, the soft load
of m's own group over m's tokens, ``L_m = mean_t p(group(m) | x_t)``, and the loss ``mean_m -log L_m``; it pulls
each modality's group load toward the group that serves it (``train_mm.train`` adds it, weighted, to the
language-model loss). Routing itself is unchanged by the binding: the group gate still decides per token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from zoo.moe import Router, Routing
from zoo.moe.context import AUDIO, TEXT, VISION
from zoo.components.controls import Control, layer_experts, layer_top_k

MODALITY_TAGS = {"text": TEXT, "vision": VISION, "audio": AUDIO}


class HierarchicalModality(Router):
    name = "hierarchical-modality"
    summary = "MoHAVE two-level routing: a group gate picks modality groups, then top-k inside each kept group."
    paper = ("Kim et al., MoHAVE: Mixture of Hierarchical Audio-Visual Experts for Robust Speech Recognition, "
             "ICML 2025, arXiv:2502.10447")
    card = "cards/hierarchical-modality.md"
    space = "multimodal-digits"
    uses_context = True  # the token modalities, for the group-load biasing loss while training

    @classmethod
    def demo_controls(cls, model=None):
        top_k = super().demo_controls(model)[0]  # at most the experts of a half (the mild preset's groups)
        return [top_k.with_range(high=max(1, (layer_experts(model) or 8) // 2)),
                Control("group_sizes", "json", None, optional=True,
                        help="experts per group, summing to the layer's experts (empty: one group)"),
                Control("top_groups", "int", 1, low=1, high=2, step=1, help="groups kept per token (divides top-k)")]

    @classmethod
    def demo_presets(cls, model=None):
        """Groups over a model's experts: two halves (mild) or four quarters (strong), one kept per token."""
        n, k = layer_experts(model) or 8, layer_top_k(model) or 2
        presets = {}
        for strength, parts in (("mild", 2), ("strong", 4)):
            parts = parts if n % parts == 0 and n // parts >= 1 else 1
            presets[strength] = {"top_k": min(k, n // parts), "group_sizes": [n // parts] * parts, "top_groups": 1}
        return presets

    def __init__(self, hidden_size, num_experts, top_k, group_sizes: list[int] | None = None, top_groups: int = 1,
                 modalities: list[str] | None = None, **options):
        group_sizes = [int(n) for n in (group_sizes or [num_experts])]
        top_groups = int(top_groups)
        if modalities is not None:
            if (not isinstance(modalities, (list, tuple)) or len(modalities) != len(group_sizes)
                    or any(m not in MODALITY_TAGS for m in modalities) or len(set(modalities)) != len(modalities)):
                raise ValueError(f"modalities must name, for each of the {len(group_sizes)} groups, a distinct modality "
                                 f"among {sorted(MODALITY_TAGS)} (or be None: no binding), got {modalities!r}")
            modalities = [str(m) for m in modalities]
        if sum(group_sizes) != num_experts or min(group_sizes) < 1:
            raise ValueError(f"group_sizes {group_sizes} must be positive and sum to num_experts={num_experts}")
        if not 1 <= top_groups <= len(group_sizes) or top_k % top_groups:
            raise ValueError(f"top_groups={top_groups} must be in [1, {len(group_sizes)}] and divide top_k={top_k}")
        if top_k // top_groups > min(group_sizes):
            raise ValueError(f"{top_k // top_groups} experts per group but the smallest group has {min(group_sizes)}")
        bound = {"modalities": modalities} if modalities is not None else {}  # unbound: the options as before
        super().__init__(hidden_size, num_experts, top_k, group_sizes=group_sizes, top_groups=top_groups, **bound,
                         **options)
        self.group_sizes, self.top_groups, self.modalities = group_sizes, top_groups, modalities
        self.group_load_loss: torch.Tensor | None = None  # the last training forward's group-load biasing loss
        self.group_weight = nn.Parameter(torch.empty(len(group_sizes), hidden_size))
        nn.init.normal_(self.group_weight, std=0.02)
        self.group_of = [g for g, n in enumerate(group_sizes) for _ in range(n)]  # plain list: no meta buffers

    def init_weights(self, std: float) -> None:
        super().init_weights(std)
        init.normal_(self.group_weight, mean=0.0, std=std)

    def membership(self, device) -> torch.Tensor:
        """[G, E] bool: expert e belongs to group g."""
        group_of = torch.tensor(self.group_of, device=device)
        return group_of[None, :] == torch.arange(len(self.group_sizes), device=device)[:, None]

    def group_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.group_weight)

    def bind(self, modalities: list[str]) -> "HierarchicalModality":
        """Bind group g to ``modalities[g]`` (recorded in the options, so a save keeps it); checked as in __init__."""
        checked = type(self)(self.hidden_size, self.num_experts, self.top_k, group_sizes=self.group_sizes,
                             top_groups=self.top_groups, modalities=list(modalities))
        self.modalities = checked.modalities
        self.options = {**self.options, "modalities": checked.modalities}
        return self

    def biasing_loss(self, g_logits: torch.Tensor, modality: torch.Tensor, real: torch.Tensor | None = None):
        """MoHAVE's group-load biasing: ``mean_m -log(mean over m's real tokens of p(group(m)))`` over the bound
        modalities present; None when no bound modality is present. ``modality`` [T] tags, ``real`` [T] bool."""
        probs = g_logits.float().softmax(-1)
        terms = []
        for g, name in enumerate(self.modalities or []):
            rows = modality == MODALITY_TAGS[name]
            if real is not None:
                rows = rows & real
            if bool(rows.any()):
                terms.append(-torch.log(probs[rows, g].mean().clamp_min(1e-9)))
        return torch.stack(terms).mean() if terms else None

    def forward(self, hidden: torch.Tensor, context=None) -> Routing:
        tokens, member = hidden.shape[0], self.membership(hidden.device)
        g_logits = self.group_logits(hidden).float()  # [T, G]
        self.group_load_loss = None
        if self.training and self.modalities and context is not None and context.modality is not None:
            real = None if context.attention_mask is None else context.rows("attention_mask", tokens).bool()
            self.group_load_loss = self.biasing_loss(g_logits, context.rows("modality", tokens).to(hidden.device),
                                                     None if real is None else real.to(hidden.device))
        e_logits = self.gate_logits(hidden).float()  # [T, E]
        in_group = e_logits[:, None, :].masked_fill(~member, float("-inf")).log_softmax(-1)  # [T, G, E]
        g_top, g_idx = g_logits.topk(self.top_groups, dim=-1)  # [T, g]
        g_w = g_top.softmax(-1)
        kept = in_group.gather(1, g_idx[..., None].expand(-1, -1, self.num_experts))  # [T, g, E]
        e_top, e_idx = kept.topk(self.top_k // self.top_groups, dim=-1)  # [T, g, k/g]
        e_w = e_top.softmax(-1)  # in-group weights renormalised over the kept experts
        weights = (g_w[..., None] * e_w).reshape(tokens, self.top_k)
        logits = g_logits.log_softmax(-1) @ member.to(g_logits.dtype) + in_group.amax(1)  # amax: own group
        return Routing(weights=weights.to(hidden.dtype), indices=e_idx.reshape(tokens, self.top_k), logits=logits)

    def group_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, G] the group gate's softmax (what the usage plots show)."""
        return self.group_logits(hidden).float().softmax(-1)


def bind_groups(model) -> list[HierarchicalModality]:
    """Bind every ``hierarchical-modality`` router of a zoo_mm model to its experts' group names (modality-groups:
    text, vision, audio); returns the routers."""
    from zoo.moe.layout import moe_layers

    routers = []
    for _, moe in moe_layers(model):
        if isinstance(moe.router, HierarchicalModality):
            groups = getattr(moe.experts, "groups", None)
            if groups is None:
                raise ValueError("bind_groups needs modality-groups experts (they name each group's modality)")
            routers.append(moe.router.bind(groups))
    return routers


def group_load_loss(routers) -> torch.Tensor | None:
    """The mean over ``routers`` of their last training forward's group-load biasing loss (None if none has one)."""
    terms = [r.group_load_loss for r in routers if r.group_load_loss is not None]
    return torch.stack(terms).mean() if terms else None
