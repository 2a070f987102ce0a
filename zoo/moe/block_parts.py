"""Parts a MoE block may hold around its router and experts (beyond shared experts), each a layout entry of its own
that ``build_block`` rebuilds and every compressor carries (``SparseMoE.with_parts``). In the order the block
applies them to its input ``x [T, H]``:

- ``input_proj`` [H -> M] then ``input_norm`` [M]: what the routed experts read (Muse Spark's latent experts work in
  a narrower space M; Gemma 4 norms a copy of the input). The router and the shared experts read ``x`` itself.
- ``expert_output_norm`` [M]: each expert's output, normed before its routing weight scales it (Muse Spark).
- ``output_proj`` [M -> H]: the weighted sum back to the model's width (Muse Spark).
- ``output_bias`` [H]: added to the routed output (JetMoE).
- ``output_norm`` [H]: the block's output, routed plus shared (A.X-K1, Gemma 4).
"""
from __future__ import annotations

import torch
from torch import nn

from zoo.moe.norms import BlockRMSNorm


class BlockLinear(nn.Linear):
    """A projection between the model's width and the experts' (no bias)."""

    def __init__(self, in_features: int, out_features: int):
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        super().__init__(in_features, out_features, bias=False)

    def options(self) -> dict:
        return {"in_features": self.in_features, "out_features": self.out_features}


class BlockBias(nn.Module):
    """A bias added to the block's routed output."""

    def __init__(self, hidden_size: int):
        super().__init__()
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"hidden_size must be a positive integer, got {hidden_size!r}")
        self.hidden_size = hidden_size
        self.bias = nn.Parameter(torch.zeros(hidden_size))

    def options(self) -> dict:
        return {"hidden_size": self.hidden_size}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias

    def extra_repr(self) -> str:
        return str(self.hidden_size)


class PartsMismatch(ValueError):
    """Parts of a block that do not fit its router and experts; ``problems`` names each (see ``part_problems``)."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


PARTS = {"input_proj": BlockLinear, "input_norm": BlockRMSNorm, "expert_output_norm": BlockRMSNorm,
         "output_proj": BlockLinear, "output_bias": BlockBias, "output_norm": BlockRMSNorm}


def part_problems(parts: dict, hidden_size: int, expert_size: int) -> list[str]:
    """What does not fit among a block's parts (name -> module or None), for a model of width ``hidden_size`` whose
    experts read and write ``expert_size``: one message per problem, each starting with the part's name."""
    proj_in, proj_out = parts.get("input_proj"), parts.get("output_proj")
    problems = []
    if (proj_in is None) != (proj_out is None):
        problems.append(f"{'input_proj' if proj_out is None else 'output_proj'}: a latent block needs both "
                        "input_proj and output_proj")
    if proj_in is None and expert_size != hidden_size:
        problems.append(f"experts_options.hidden_size: {expert_size}, but the model's hidden_size is {hidden_size} "
                        "(experts of another width need input_proj and output_proj)")
    model, experts = f"the model's hidden_size is {hidden_size}", f"the experts' hidden_size is {expert_size}"
    want = {"input_norm": (expert_size, experts), "expert_output_norm": (expert_size, experts),
            "output_bias": (hidden_size, model), "output_norm": (hidden_size, model)}
    for name, (size, why) in want.items():
        part = parts.get(name)
        if part is not None and part.hidden_size != size:
            problems.append(f"{name}.hidden_size: {part.hidden_size}, but {why}")
    for name, (fan_in, fan_out) in (("input_proj", (hidden_size, expert_size)),
                                    ("output_proj", (expert_size, hidden_size))):
        part = parts.get(name)
        if part is not None and (part.in_features, part.out_features) != (fan_in, fan_out):
            problems.append(f"{name}: {part.in_features} -> {part.out_features}, but it must be {fan_in} -> {fan_out}")
    return problems
