"""mofme experts: MoFME's Feature Modulated Experts (Zhang et al., AAAI 2024, arXiv:2312.16610).

One shared SwiGLU FFN per layer; expert e is that FFN with its hidden activations modulated feature-wise, FiLM
style: ``E_e(x) = down(gamma_e * act(gate x) * (up x) + beta_e)``. Each expert costs ``2 * I`` numbers (its
gamma and beta), so E experts cost one FFN plus ``2 * E * I``, and one token costs one FFN whatever k is: the
down projection is linear, so the k modulations are mixed first (``sum_k w_k gamma_k``, ``sum_k w_k beta_k``) and
the shared FFN runs once per token. ``film="output"`` (the zoo's variant) modulates the FFN's output instead
(width H). Identity init (gamma 1, beta 0) makes every expert the shared FFN, so a model upcycled with
renormalised top-k weights starts as the dense model.

The paper pairs these experts with its uncertainty-aware router (``zoo_routers.uncertainty_aware``);
``upcycle`` with ``experts="mofme"`` builds both from a dense decoder.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from zoo.moe.dispatch import gather_rows
from zoo.moe.experts import ACTIVATIONS, PARAMETERS, Experts, SwiGLUExperts, naive_experts
from zoo.components.options import check_options

FILM_ON = ("hidden", "output")
PAPER = ("Zhang et al., Efficient Deweather Mixture-of-Experts with Uncertainty-aware Feature-wise Linear "
         "Modulation, AAAI 2024, arXiv:2312.16610")
# activations without extra parameters (clamped variants would need their limits recorded too)
PLAIN_ACTIVATIONS = tuple(sorted(a for a in ACTIVATIONS if a not in PARAMETERS))


class MofmeExperts(Experts):
    """``gate_up_proj [2I, H]`` and ``down_proj [H, I]`` shared by all experts; ``film_gamma [E, W]`` and
    ``film_beta [E, W]`` per expert, W = I (``film="hidden"``, the paper's) or H (``film="output"``)."""

    name = "mofme"
    summary = ("MoFME: one shared SwiGLU FFN, each expert a feature-wise scale and shift (FiLM) of its hidden "
               "activations; E experts cost one FFN + 2*E*I.")
    paper = PAPER
    card = "cards/mofme.md"
    space = "adapter-lab"

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str = "silu",
                 film: str = "hidden"):
        super().__init__()
        check_options(type(self), {"activation": activation, "film": film})
        for label, value in (("num_experts", num_experts), ("hidden_size", hidden_size),
                             ("intermediate_size", intermediate_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"mofme: {label} must be a positive integer, got {value!r}")
        if activation not in PLAIN_ACTIVATIONS:
            raise ValueError(f"mofme: activation must be one of {PLAIN_ACTIVATIONS}, got {activation!r}")
        if film not in FILM_ON:
            raise ValueError(f"mofme: film must be one of {FILM_ON} (where the modulation applies), got {film!r}")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.activation, self.film, self._act = activation, film, ACTIVATIONS[activation]
        width = intermediate_size if film == "hidden" else hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(hidden_size, intermediate_size))
        self.film_gamma = nn.Parameter(torch.ones(num_experts, width))   # identity modulation at init
        self.film_beta = nn.Parameter(torch.zeros(num_experts, width))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def options(self) -> dict:
        return {"num_experts": self.num_experts, "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size, "activation": self.activation, "film": self.film}

    def init_weights(self, std: float) -> None:
        """What a load left missing: the shared FFN as transformers initialises an FFN, the FiLM as identity."""
        init.normal_(self.gate_up_proj, mean=0.0, std=std)
        init.normal_(self.down_proj, mean=0.0, std=std)
        init.ones_(self.film_gamma)
        init.zeros_(self.film_beta)

    # ---- sizes: what is stored is what is read (the shared FFN once, k modulations per token) ----------------
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def active_parameters(self, k: int) -> int:
        return self.gate_up_proj.numel() + self.down_proj.numel() + 2 * k * self.film_gamma.shape[1]

    # ---- building ---------------------------------------------------------------------------------------------
    @classmethod
    @torch.no_grad()
    def from_ffn(cls, gate_up: torch.Tensor, down: torch.Tensor, num_experts: int, activation: str = "silu",
                 film: str = "hidden") -> "MofmeExperts":
        """E identity-modulated experts around one FFN (``gate_up [2I, H]``, gate rows first; ``down [H, I]``)."""
        H, I = down.shape
        new = cls(num_experts, H, I, activation=activation, film=film).to(device=down.device, dtype=down.dtype)
        new.gate_up_proj.copy_(gate_up)
        new.down_proj.copy_(down)
        return new

    @classmethod
    def from_dense(cls, experts: SwiGLUExperts, film: str = "hidden") -> "MofmeExperts":
        """The shared FFN as the mean of a layer's dense SwiGLU experts (their plain merge), identity FiLM."""
        if not isinstance(experts, SwiGLUExperts) or experts.gate_up_proj_bias is not None \
                or experts.activation not in PLAIN_ACTIVATIONS:
            raise ValueError(f"mofme is built from dense swiglu experts without biases, not {experts.name!r} experts")
        return cls.from_ffn(experts.gate_up_proj.mean(0), experts.down_proj.mean(0), experts.num_experts,
                            experts.activation, film)

    # ---- compute ----------------------------------------------------------------------------------------------
    def shared_hidden(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return self._act(gate, up)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e alone on ``x [n, H]``: the shared FFN with expert e's FiLM (the reference's building block)."""
        h = self.shared_hidden(x)
        if self.film == "hidden":
            return F.linear(self.film_gamma[e] * h + self.film_beta[e], self.down_proj)
        return self.film_gamma[e] * F.linear(h, self.down_proj) + self.film_beta[e]

    def forward(self, hidden: torch.Tensor, routing) -> torch.Tensor:
        # sum_k w_k (gamma_k * z + beta_k) = (sum_k w_k gamma_k) * z + sum_k w_k beta_k, and down() is linear: mix
        # the k modulations per token, run the shared FFN once. Gathers only: no host sync, static shapes.
        T, k = routing.indices.shape
        idx, valid = gather_rows(routing.indices, self.num_experts)
        w = torch.where(valid, routing.weights.reshape(-1), 0).to(hidden.dtype).view(T, 1, k)  # empty slots: 0
        gamma = torch.bmm(w, self.film_gamma[idx].view(T, k, -1)).squeeze(1)
        beta = torch.bmm(w, self.film_beta[idx].view(T, k, -1)).squeeze(1)
        h = self.shared_hidden(hidden)
        if self.film == "hidden":
            return F.linear(gamma * h + beta, self.down_proj)
        return gamma * F.linear(h, self.down_proj) + beta

    reference = naive_experts  # one (token, slot) pair at a time through ``expert(e, x)``, weighted and summed
