"""mixture-of-heads: MoH (Jin et al., 2024). Attention heads are the experts: a router over the token's hidden
state (the attention input) keeps its top-k routed heads, shared heads are always on, and the attention output
is the gated sum of the head outputs, ``o = sum_h g_h head_h W_O^h`` (each head's slice of the ``o_proj`` input
scaled by its gate; unselected heads get 0).

Gates follow the paper's two-stage routing, scaled as in the authors' released code so that a zero router is the
dense model: shared heads ``2 a_1 h_s softmax(W_s x)``, kept routed heads ``2 a_2 k softmax(W_r x)`` renormalised
over the k kept ones, ``[a_1, a_2] = softmax(W_h x)``. All router weights start at zero: every active gate is 1.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from zoo.moe.layout import decoder_layers
from zoo.components.controls import Control


class HeadRouting(NamedTuple):
    gates: torch.Tensor  # [..., heads] shared heads first; 0 for routed heads not kept
    probs: torch.Tensor | None = None  # [..., routed] softmax over all routed heads (balance loss)
    chosen: torch.Tensor | None = None  # [..., routed] bool, the kept routed heads


def head_count(value, num_heads: int, label: str, minimum: int) -> int:
    """A count (int) or a fraction of ``num_heads`` (float in (0, 1], rounded down) -> a count."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{label} must be a head count (int) or a fraction of the heads (float), got {value!r}")
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise ValueError(f"{label} as a fraction must be in (0, 1], got {value}")
        value = math.floor(value * num_heads + 1e-9)
    if not minimum <= value <= num_heads:
        raise ValueError(f"{label} is {value} heads; this attention has {num_heads} (at least {minimum} needed)")
    return int(value)


def unit_softmax(logits: torch.Tensor, keep: torch.Tensor | None = None, n: int | None = None) -> torch.Tensor:
    """``n * softmax`` over the kept entries (all, or ``keep``; n of them), 0 elsewhere: the kept gates average 1,
    and tied logits give exactly 1."""
    logits = logits.float()
    if keep is not None:
        logits = logits.masked_fill(~keep, -torch.inf)
    e = (logits - logits.amax(-1, keepdim=True)).exp()
    return e * (n or logits.shape[-1]) / e.sum(-1, keepdim=True)


class MixtureOfHeads(nn.Module):
    """The head router of one attention layer: ``forward(hidden [..., H]) -> HeadRouting``. ``num_experts`` is the
    number of heads (heads are the experts). Applied with ``zoo.apply``, which wraps every self-attention."""

    name = "mixture-of-heads"
    summary = "MoH: attention heads as experts; each token keeps its top-k routed heads plus shared heads."
    paper = ("Jin, Zhu, Yuan, Yan. MoH: Multi-Head Attention as Mixture-of-Head Attention, 2024 (ICML 2025). "
             "arXiv:2410.11842")
    card = "cards/mixture-of-heads.md"
    space = "router-explorer"
    target = "attention"  # zoo.apply: wraps self-attention, not the SparseMoE routers

    # Attention heads are its experts: a Space's top-k is heads_per_token here (no zoo.Router base: declared here).
    @classmethod
    def demo_controls(cls, model=None):
        heads = getattr(model.config.get_text_config(), "num_attention_heads", None) if model is not None else None
        unit = 1 / heads if heads else 0.125  # one head
        return [Control("heads_per_token", "float", 0.75, low=max(unit, 0.125), high=1.0, step=unit,
                        help="share of the heads each token keeps"),
                Control("shared_heads", "float", None, low=max(unit, 0.125), high=0.5, step=unit, optional=True,
                        help="share of the heads always on, fewer than those kept (empty: half of them)")]

    @classmethod
    def demo_presets(cls, model=None):
        return {"mild": {"heads_per_token": 0.75}, "strong": {"heads_per_token": 0.5}}

    def __init__(self, hidden_size: int, num_experts: int, heads_per_token: float = 0.75,
                 shared_heads: float | None = None):
        super().__init__()
        heads = int(num_experts)
        active = head_count(heads_per_token, heads, "heads_per_token", 1)
        shared = active // 2 if shared_heads is None else head_count(shared_heads, heads, "shared_heads", 0)
        if shared > active or (shared == active < heads):
            raise ValueError(f"shared_heads={shared} must be fewer than heads_per_token={active} (or all heads "
                             f"active): otherwise no routed head is left to choose")
        self.hidden_size, self.num_experts = int(hidden_size), heads
        self.num_shared, self.num_routed, self.top_k = shared, heads - shared, active - shared
        self.options = {"heads_per_token": active, "shared_heads": shared}
        self.shared_gate = nn.Linear(hidden_size, shared, bias=False) if shared > 1 else None
        self.routed_gate = nn.Linear(hidden_size, self.num_routed, bias=False) if self.num_routed else None
        self.group_gate = nn.Linear(hidden_size, 2, bias=False) if shared and self.num_routed else None
        for p in self.parameters():
            nn.init.zeros_(p)  # a zero router: every active head gets gate 1 (the dense model at all heads)

    def forward(self, hidden: torch.Tensor) -> HeadRouting:
        lead = hidden.shape[:-1]
        parts, probs, chosen = [], None, None
        if self.num_shared:
            shared = (unit_softmax(self.shared_gate(hidden)) if self.shared_gate is not None
                      else hidden.new_ones(*lead, 1, dtype=torch.float32))
            parts.append(shared)
        if self.num_routed:
            logits = self.routed_gate(hidden)
            probs = torch.softmax(logits.float(), dim=-1)
            if self.top_k == self.num_routed:
                chosen = torch.ones_like(probs, dtype=torch.bool)
            else:
                index = logits.topk(self.top_k, dim=-1).indices
                chosen = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, index, True)
            parts.append(unit_softmax(logits, chosen, self.top_k))
        if self.group_gate is not None:
            group = 2 * torch.softmax(self.group_gate(hidden).float(), dim=-1)
            parts = [parts[0] * group[..., :1], parts[1] * group[..., 1:]]
        return HeadRouting(torch.cat(parts, dim=-1), probs, chosen)

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden_size}, heads={self.num_experts}, shared={self.num_shared}, "
                f"routed top-{self.top_k} of {self.num_routed}")

    @classmethod
    def attach(cls, model, layers=None, **options):
        """Wrap the self-attention of every decoder layer (or of ``layers``). Every layer is checked and its router
        built before any layer changes, so a bad option leaves the model as it was."""
        config, decoder = model.config.get_text_config(), decoder_layers(model)
        heads = getattr(config, "num_attention_heads", None)
        routers = {}
        for i in range(len(decoder)) if layers is None else layers:
            o_proj = getattr(decoder[i].self_attn, "o_proj", None)
            width = getattr(o_proj, "in_features", None)
            if not heads or not width or width % heads:
                raise TypeError(f"mixture-of-heads needs a self-attention whose linear o_proj reads "
                                f"num_attention_heads equal head slices; {config.model_type} layer {i} has none")
            router = cls(config.hidden_size, heads, **options)
            routers[i] = router.to(o_proj.weight.device, o_proj.weight.dtype)
        for i, router in routers.items():
            decoder[i].self_attn = MixedHeadsAttention(decoder[i].self_attn, router)
        return model


class MixedHeadsAttention(nn.Module):
    """A family's own attention whose heads are mixed per token by ``router``: its ``o_proj`` moves here and reads
    the gated head outputs. Re-wrapping a wrapped attention replaces the router."""

    def __init__(self, attention: nn.Module, router: MixtureOfHeads):
        super().__init__()
        if isinstance(attention, MixedHeadsAttention):
            attention, o_proj = attention.attention, attention.o_proj
        else:
            o_proj, attention.o_proj = attention.o_proj, nn.Identity()
        self.attention, self.o_proj, self.router = attention, o_proj, router

    def layout(self) -> dict:
        """What ``zoo_attention`` records for this layer (``zoo.moe.layout`` rebuilds it on load)."""
        return {"router": self.router.name, "options": dict(self.router.options)}

    def forward(self, hidden_states, *args, **kwargs):
        result = self.attention(hidden_states, *args, **kwargs)  # [..., heads * head_dim], before o_proj
        # transformers' attentions return (output, weights); others (zoo_mm's) the output alone: answer in kind
        out = result if torch.is_tensor(result) else result[0]
        gates = self.router(hidden_states).gates.to(out.dtype)
        heads = out.unflatten(-1, (self.router.num_experts, -1)) * gates.unsqueeze(-1)
        out = self.o_proj(heads.flatten(-2))
        return out if torch.is_tensor(result) else (out, *result[1:])


def head_balance_loss(routing: HeadRouting, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """MoH's load-balancing loss for one layer over the routed heads: ``E * sum_i f_i P_i`` (f_i: share of the kept
    (token, slot) pairs that went to head i; P_i: its mean softmax probability), over non-padding tokens.
    1 for perfectly uniform routing; 0 when nothing is routed."""
    if routing.probs is None:
        return routing.gates.new_zeros(())
    probs = routing.probs.reshape(-1, routing.probs.shape[-1])
    chosen = routing.chosen.reshape(probs.shape).float()
    mask = torch.ones(len(probs), device=probs.device) if attention_mask is None else \
        attention_mask.reshape(-1).to(probs.device, probs.dtype)
    denom = mask.sum().clamp(min=1)
    f = (chosen * mask[:, None]).sum(0) / (denom * chosen[0].sum().clamp(min=1))
    p = (probs * mask[:, None]).sum(0) / denom
    return probs.shape[-1] * (f * p).sum()
