"""Grouped LoRA on fused experts: each expert runs on its own token slice as
``y = x W_e^T + scale * (x A_e^T) B_e^T``, so the E x out x in effective weight ``W + scale * B A`` is never built.

PEFT owns the factors: ``ParamWrapper`` here is PEFT's own ``lora.ParamWrapper`` (one per targeted parameter,
nested when both ``gate_up_proj`` and ``down_proj`` are targeted) with only ``forward`` replaced. Saving, loading,
merging and unloading stay PEFT's. Cases the grouped path does not cover (merged, disabled, several active
adapters) fall back to PEFT's path, which folds the update into the weight.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from peft.tuners.lora import layer as peft_lora

from zoo.moe import SwiGLUExperts
from zoo.moe.dispatch import combine, gather_rows, sort_by_expert

TARGETS = ("gate_up_proj", "down_proj")


def factors(wrapper: peft_lora.ParamWrapper, adapter: str):
    """``(A [E, r, in], B [E, out, r], scale)`` of one adapter, as views of PEFT's ``lora_A``/``lora_B``.

    PEFT stores a 3-D parameter's LoRA as ``lora_A: Linear(in, r*E)`` (expert e owns rows ``e*r:(e+1)*r``) and
    ``lora_B: Linear(r*E, out)`` (rank j of expert e is column ``j*E + e``); the zoo's ``[E, out, in]`` layout is
    not transposed, so expert e's update is ``scale * B[e] @ A[e]``, shaped like ``W[e]``.
    """
    a = wrapper.lora_A[adapter].weight
    b = wrapper.lora_B[adapter].weight
    n = wrapper.num_experts
    return a.reshape(n, -1, a.shape[-1]), b.reshape(b.shape[0], -1, n).permute(2, 0, 1), wrapper.scaling[adapter]


def low_rank(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * (x a^T) b^T`` in the factors' own dtype (fp32 LoRA weights), autocast off: the matmuls are small,
    and on CPU each new bf16 matmul shape (every expert's token count changes each step) builds a kernel."""
    with torch.autocast(x.device.type, enabled=False):
        return scale * (x.to(a.dtype) @ a.transpose(-1, -2)) @ b.transpose(-1, -2)


def _linear(experts, name: str, e: int, x: torch.Tensor, lora: dict) -> torch.Tensor:
    """Expert ``e``'s projection ``name`` on its token slice, plus its low-rank update when present."""
    bias = getattr(experts, f"{name}_bias")
    y = F.linear(x, getattr(experts, name)[e], None if bias is None else bias[e])
    if name in lora:
        a, b, scale = lora[name]
        y = y + low_rank(x, a[e], b[e], scale).to(y.dtype)
    return y


def grouped_forward(experts: SwiGLUExperts, hidden: torch.Tensor, routing, lora: dict) -> torch.Tensor:
    """SwiGLUExperts' sorted dispatch with LoRA factors ``{param name: (A, B, scale)}`` added per expert."""
    if torch.compiler.is_compiling() and routing.indices.numel() <= experts.num_experts:
        return gathered_forward(experts, hidden, routing, lora)
    plan = sort_by_expert(routing.indices, experts.num_experts)
    x = hidden.index_select(0, plan.token)
    outs, start = [], 0
    for e, n in enumerate(plan.counts):  # host-side counts: prefill / training only
        if n:
            h = _linear(experts, "gate_up_proj", e, x[start:start + n], lora)
            outs.append(_linear(experts, "down_proj", e, experts.glu(h), lora))
        start += n
    y = torch.cat(outs) if outs else x[:0]
    return combine(y, routing.weights, plan, hidden.shape[0])


def _gathered_linear(experts, name: str, idx: torch.Tensor, x: torch.Tensor, lora: dict) -> torch.Tensor:
    y = torch.bmm(getattr(experts, name)[idx], x.unsqueeze(-1)).squeeze(-1)
    bias = getattr(experts, f"{name}_bias")
    if bias is not None:
        y = y + bias[idx]
    if name in lora:  # per slot: [1, in] @ [in, r] @ [r, out]; only r x (in + out) per slot is gathered
        a, b, scale = lora[name]
        y = y + low_rank(x.unsqueeze(1), a[idx], b[idx], scale).squeeze(1).to(y.dtype)
    return y


def gathered_forward(experts: SwiGLUExperts, hidden: torch.Tensor, routing, lora: dict) -> torch.Tensor:
    """Decode (few tokens, compiled): gather the selected experts' weights and factors, no host sync."""
    idx, valid = gather_rows(routing.indices, experts.num_experts)
    k = routing.indices.shape[1]
    x = hidden.repeat_interleave(k, dim=0)
    y = _gathered_linear(experts, "down_proj", idx, experts.glu(_gathered_linear(experts, "gate_up_proj", idx, x, lora)),
                         lora)
    w = torch.where(valid, routing.weights.reshape(-1), 0).to(y.dtype)
    return (y * w[:, None]).view(hidden.shape[0], k, y.shape[-1]).sum(1).to(hidden.dtype)


class ParamWrapper(peft_lora.ParamWrapper):
    """PEFT's ParamWrapper around a zoo ``SwiGLUExperts`` parameter, with the grouped forward.

    Registered with ``LoraConfig._register_custom_module({SwiGLUExperts: ParamWrapper})`` (PEFT's extension point
    for custom LoRA layers), so PEFT builds it in place of its own. It keeps the class name: PEFT finds nested
    wrappers by that name. To the zoo it reads like the experts it wraps (``name``, ``options()``, sizes), so
    layouts record the base kind and the adapter stays PEFT's.
    """

    def forward(self, hidden, routing):
        lora = self._grouped_factors()
        if lora is None:
            return super().forward(hidden, routing)
        return grouped_forward(self.get_base_layer(), hidden, routing, lora)

    def _grouped_factors(self) -> dict | None:
        """Factors of every wrapper down the nested chain, or None when PEFT's own path must run."""
        if type(self.get_base_layer()) is not SwiGLUExperts:  # other kinds compute differently: let PEFT fold
            return None
        lora, wrapper = {}, self
        while isinstance(wrapper, peft_lora.ParamWrapper):
            active = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
            if wrapper.disable_adapters or wrapper.merged or len(active) != 1:
                return None
            lora[wrapper.parameter_name] = factors(wrapper, active[0])
            wrapper = wrapper.base_layer
        return lora

    # --- what the zoo reads off an Experts module (layouts, sizes) -------------------------------------------
    @property
    def name(self) -> str:
        return self.get_base_layer().name

    def options(self) -> dict:
        return self.get_base_layer().options()

    def num_parameters(self) -> int:
        return sum(t.numel() for t in self.state_dict().values())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state_dict().values())

    def active_parameters(self, k: int) -> int:
        return self.num_parameters() * k // self.num_experts  # base and LoRA factors are both per expert
