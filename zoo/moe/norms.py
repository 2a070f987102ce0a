"""RMS norms a MoE block may hold around its experts (``SparseMoE.input_norm`` / ``expert_output_norm`` /
``output_norm``), in the forms transformers' families use. They differ in where the weight is applied and in which
precision, which matters in half precision: ``weight-after-cast`` (Llama, DeepSeek: ``w * norm(x).to(dtype)``),
``weight-in-fp32`` (Gemma 4: ``(norm(x) * w).to(dtype)``), ``offset`` (Gemma 2/3: ``(norm(x) * (1 + w)).to(dtype)``
with ``1 + w`` in fp32), ``offset-in-dtype`` (Muse Spark's pre-expert norm: the same with ``1 + w`` summed in the
weight's dtype) and ``input-offset`` (Muse Spark's post-expert norm: ``norm((x * (1 + w)).to(dtype)).to(dtype)``,
``1 + w`` in the weight's dtype: the weight scales the channels before the mean square)."""
from __future__ import annotations

import torch
from torch import nn

STYLES = ("weight-after-cast", "weight-in-fp32", "offset", "offset-in-dtype", "input-offset")


class BlockRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, style: str = "weight-after-cast"):
        super().__init__()
        if style not in STYLES:
            raise ValueError(f"unknown RMS norm style {style!r}; choose from {', '.join(STYLES)}")
        if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps >= 0):
            raise ValueError(f"eps must be a non-negative number, got {eps!r}")
        self.hidden_size, self.eps, self.style = int(hidden_size), float(eps), style
        self.weight = nn.Parameter(torch.zeros(hidden_size) if "offset" in style else torch.ones(hidden_size))

    def options(self) -> dict:
        return {"hidden_size": self.hidden_size, "eps": self.eps, "style": self.style}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style == "input-offset":
            x = (x.float() * (1.0 + self.weight).float()).to(x.dtype)
            h = x.float()
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.style == "weight-after-cast":
            return self.weight * h.to(x.dtype)
        scale = {"weight-in-fp32": lambda w: w.float(), "offset": lambda w: 1.0 + w.float(),
                 "offset-in-dtype": lambda w: (1.0 + w).float()}[self.style](self.weight)
        return (h * scale).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, style={self.style}"


def as_block_norm(native: nn.Module, hidden_size: int) -> dict | None:
    """The options of the ``BlockRMSNorm`` that computes ``native`` (a family's RMS norm with one [H] weight),
    found on random inputs and weights in fp32 and bf16; None when none of the styles does."""
    weights = [p for _, p in native.named_parameters()]
    if len(weights) != 1 or tuple(weights[0].shape) != (hidden_size,) or list(native.buffers()):
        return None
    eps = next((float(getattr(native, k)) for k in ("variance_epsilon", "eps", "epsilon")
                if isinstance(getattr(native, k, None), (int, float))), None)
    if eps is None:
        return None
    import copy

    gen = torch.Generator().manual_seed(0)
    twin = copy.deepcopy(native)
    twin = (twin.to_empty(device="cpu") if weights[0].is_meta else twin).float()
    with torch.no_grad():
        next(twin.parameters()).copy_((torch.randn(hidden_size, generator=gen) * 0.5 + 1).bfloat16().float())
    x = torch.randn(64, hidden_size, generator=gen) * 3
    # every style agrees in fp32 up to rounding; in bf16 the one the family computes matches (nearly) bit for bit
    fits = {}
    for style in STYLES:
        ours = BlockRMSNorm(hidden_size, eps, style)
        with torch.no_grad():
            ours.weight.copy_(next(twin.parameters()))
            if not torch.allclose(ours.float()(x), twin.float()(x), rtol=1e-5, atol=1e-6):
                continue
            half = x.bfloat16()
            fits[style] = (ours.bfloat16()(half) != copy.deepcopy(twin).bfloat16()(half)).sum().item()
    if not fits:
        return None
    return BlockRMSNorm(hidden_size, eps, min(fits, key=fits.get)).options()
