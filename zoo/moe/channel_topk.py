"""Experts that read only part of their down projection: per token, the k intermediate channels with the
largest |h_i| * ||W_down[:, i]|| (weight-informed, calibration-free), k = budget * I."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from zoo.moe.experts import SwiGLUExperts


class ChannelTopKExperts(SwiGLUExperts):
    name = "channel-topk"
    summary = "Dense SwiGLU experts that read only each token's top-k intermediate channels of the down projection."
    card = "cards/channel-topk.md"
    space = "compression-lab"

    def __init__(self, *args, budget: float = 0.5, **kwargs):
        if not isinstance(budget, (int, float)) or not 0 < budget <= 1:
            raise ValueError(f"budget (fraction of channels read per token) must be in (0, 1], got {budget!r}")
        super().__init__(*args, **kwargs)
        self.budget = float(budget)
        self.channels = max(1, math.ceil(self.budget * self.intermediate_size))
        self._norms, self._norms_version = None, None

    @classmethod
    @torch.no_grad()
    def from_dense(cls, experts: SwiGLUExperts, budget: float) -> "ChannelTopKExperts":
        new = cls(**experts.options(), budget=budget).to(experts.gate_up_proj.device, experts.gate_up_proj.dtype)
        new.load_state_dict(experts.state_dict())
        return new

    def options(self) -> dict:
        return {**super().options(), "budget": self.budget}

    def column_norms(self) -> torch.Tensor:
        """||W_down[:, i]|| for every expert and channel, [E, I]; recomputed only when the weight changes."""
        version = self.down_proj._version
        if self._norms is None or self._norms_version != version:
            self._norms = self.down_proj.detach().float().norm(dim=1)
            self._norms_version = version
        return self._norms

    def select(self, e: int, h: torch.Tensor) -> torch.Tensor:
        """Indices [n, k] of the channels each token keeps: top-k of |h_i| * ||W_down[:, i]||."""
        return (h.detach().abs().float() * self.column_norms()[e]).topk(self.channels, dim=-1).indices

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        b1 = None if self.gate_up_proj_bias is None else self.gate_up_proj_bias[e]
        h = self.glu(F.linear(x, self.gate_up_proj[e], b1))  # [n, I]
        idx = self.select(e, h)  # [n, k]
        h_kept = h.gather(1, idx)  # [n, k]
        w = self.down_proj[e].t()[idx]  # [n, k, H]: only the kept columns of W_down are read
        y = torch.bmm(h_kept.unsqueeze(1), w).squeeze(1)
        return y if self.down_proj_bias is None else y + self.down_proj_bias[e]

    def forward(self, hidden, routing):
        return self._forward_sorted(hidden, routing)

    def active_parameters(self, k: int) -> int:
        per_expert = 2 * self.intermediate_size * self.hidden_size + self.channels * self.hidden_size
        return k * per_expert
