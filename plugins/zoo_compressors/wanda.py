"""Wanda weight pruning of a block's experts (Sun et al., A Simple and Effective Pruning Approach for LLMs,
arXiv:2306.11695): weight W[o, i] scores |W[o, i]| * ||X[:, i]||_2, the norm of input feature i over the
calibration tokens that reach the matrix; each output row loses its lowest-scoring ``sparsity`` share of weights.
HodgeCover's hybrid variant runs it on the experts that survive the cover.

Each expert's inputs are the calibration tokens routed to it (scaled by their routing weight where the family
scales the expert's input, Llama 4); the down projection's inputs are the expert's activated intermediate
features on those tokens, computed before any pruning (as Wanda does). An expert no token reaches scores with
all the layer's tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from zoo.moe.experts import MLPExperts, SwiGLUExperts


def _prune_rows(weight: torch.Tensor, norms: torch.Tensor, sparsity: float) -> int:
    """Zero, in place, the ``sparsity`` share of each row of ``weight [out, in]`` with the lowest |W| * norms."""
    k = int(weight.shape[1] * sparsity)
    if k == 0:
        return 0
    score = weight.detach().float().abs() * norms.float()[None, :]
    drop = score.argsort(dim=1, stable=True)[:, :k]
    weight.data.scatter_(1, drop.to(weight.device), 0)
    return k * weight.shape[0]


@torch.no_grad()
def wanda_prune_experts(moe, x: torch.Tensor, sparsity: float) -> int:
    """Prune every expert of ``moe`` (a new block: its weights are changed in place) on the tokens ``x [T, H]``
    that enter it. Returns the number of weights zeroed."""
    experts = moe.experts
    if sparsity <= 0 or x.shape[0] == 0:
        return 0
    routing = moe.route(x)
    xf = moe.expert_inputs(x).float()
    zeroed = 0
    for e in range(moe.num_experts):
        tok, slot = (routing.indices == e).nonzero(as_tuple=True)
        rows = xf[tok] if len(tok) else xf
        if len(tok) and moe.weights_scale_input:
            rows = rows * routing.weights[tok, slot].float()[:, None]
        if type(experts) is SwiGLUExperts:
            first, first_bias = experts.gate_up_proj[e], experts.gate_up_proj_bias
            hidden = experts.glu(F.linear(rows, first.float(), None if first_bias is None else first_bias[e].float()))
        elif type(experts) is MLPExperts:
            first = experts.up_proj[e]
            hidden = experts._act(F.linear(rows, first.float()))
        else:  # pragma: no cover - the compressor refuses other kinds in check_layer
            raise ValueError(f"Wanda pruning needs dense experts, not {experts.name!r}")
        down = experts.down_proj[e]
        zeroed += _prune_rows(down, hidden.norm(dim=0), sparsity)  # inputs of the down projection: unpruned first
        zeroed += _prune_rows(first, rows.norm(dim=0), sparsity)
    return zeroed
