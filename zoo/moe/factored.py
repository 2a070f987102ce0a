"""Factored experts (MoE-SVD): every expert's projections are low rank, ``W_e ~ U_e V``, with one ``V`` per
projection shared by all experts of the layer, and possibly fewer ``U`` matrices than experts (trimmed
experts reuse a kept ``U``). Experts stay factored at inference: ``V x`` is computed once per token for
the input projection, then each selected expert applies only its ``U``."""
from __future__ import annotations

import torch
from torch import nn

from zoo.moe.cpu_precision import linear
from zoo.moe.experts import ACTIVATIONS, SwiGLUExperts
from zoo.moe.init import refuse_missing


class FactoredExperts(SwiGLUExperts):
    name = "factored"
    summary = "Low-rank SwiGLU experts W_e ~ U_e V with V shared per layer (MoE-SVD), kept factored at inference."
    card = "cards/moe-svd.md"
    space = "compression-lab"

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, rank_gate_up: int,
                 rank_down: int, num_u: int | None = None, activation: str = "silu", bias: bool = False,
                 swiglu_limit: float = 7.0, swiglu_alpha: float = 1.702):
        nn.Module.__init__(self)
        num_u = num_u or num_experts
        if not 1 <= num_u <= num_experts or rank_gate_up < 1 or rank_down < 1:
            raise ValueError(f"need 1 <= num_u <= {num_experts} and positive ranks")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.activation, self.swiglu_limit, self.swiglu_alpha = activation, swiglu_limit, swiglu_alpha
        self._act = ACTIVATIONS[activation]
        self.rank_gate_up, self.rank_down, self.num_u = rank_gate_up, rank_down, num_u
        self.gate_up_u = nn.Parameter(torch.zeros(num_u, 2 * intermediate_size, rank_gate_up))
        self.gate_up_v = nn.Parameter(torch.zeros(rank_gate_up, hidden_size))
        self.down_u = nn.Parameter(torch.zeros(num_u, hidden_size, rank_down))
        self.down_v = nn.Parameter(torch.zeros(rank_down, intermediate_size))
        self.register_buffer("u_index", torch.arange(num_experts) % num_u)  # expert -> its U
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden_size)) if bias else None

    def init_weights(self, std: float) -> None:
        """Low-rank factors are a compression of trained experts: a missing one has no meaningful value."""
        refuse_missing(self)

    def options(self) -> dict:
        opts = super().options()
        opts.update(rank_gate_up=self.rank_gate_up, rank_down=self.rank_down, num_u=self.num_u)
        return opts

    def dense(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) that expert e stands for: the reference."""
        u = int(self.u_index[e])
        return self.gate_up_u[u] @ self.gate_up_v, self.down_u[u] @ self.down_v

    def expert_from_projected(self, e: int, xv: torch.Tensor) -> torch.Tensor:
        """Expert e on tokens already projected by the shared V (``xv = x V^T``)."""
        u = int(self.u_index[e])
        b1 = None if self.gate_up_proj_bias is None else self.gate_up_proj_bias[e]
        b2 = None if self.down_proj_bias is None else self.down_proj_bias[e]
        h = self.glu(linear(xv, self.gate_up_u[u], b1))
        return linear(linear(h, self.down_v), self.down_u[u], b2)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.expert_from_projected(e, linear(x, self.gate_up_v))

    def forward(self, hidden, routing):
        from zoo.moe.dispatch import combine, sort_by_expert

        xv = linear(hidden, self.gate_up_v)  # once per token, shared by every expert
        plan = sort_by_expert(routing.indices, self.num_experts)
        x = xv.index_select(0, plan.token)
        outs, start = [], 0
        for e, n in enumerate(plan.counts):
            if n:
                outs.append(self.expert_from_projected(e, x[start:start + n]))
            start += n
        y = torch.cat(outs) if outs else hidden.new_zeros(0, self.hidden_size)
        return combine(y, routing.weights, plan, hidden.shape[0])

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def active_parameters(self, k: int) -> int:
        per_u = 2 * self.intermediate_size * self.rank_gate_up + self.hidden_size * self.rank_down
        return k * per_u + self.gate_up_v.numel() + self.down_v.numel()
