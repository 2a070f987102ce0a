"""mixture-of-loras: N LoRA experts on each targeted frozen linear layer, routed per token (MoLoRA style):
``y = W x + b + (alpha / r) * sum_{i in sel(x)} w_i B_i A_i x``.

``router="learned"``: a softmax top-k router (``topk-softmax``, renormalised), trained by backprop through its
weights. ``router="remix"``: ReMix, equal non-learnable weights 1/k, the router trained as a policy with RLOO;
train with ``MixtureOfLoras.loss`` (it runs ``num_samples`` draws per sequence), a plain LM loss never reaches a
remix router. At eval both pick the top-k of their logits.

The structure is recorded in ``config.zoo_modules`` (see ``zoo.moe.layout.read_modules``), so ``save_pretrained``
writes one safetensors file with the base weights and the adapters, and ``AutoModelForCausalLM.from_pretrained``
(after ``import zoo``) rebuilds the same modules: identical logits, and the recipe step kept.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from zoo import Adapter
from zoo_adapters.linear_targets import ATTENTION, find_linears, parse_target, swap
from zoo.components.options import check_float, check_int
from zoo.components.controls import Control

ROUTERS = {"remix": "remix", "learned": "topk-softmax"}  # option value -> registered router


def router_class(kind: str):
    from zoo.components.registry import registry

    return registry.get("router", ROUTERS[kind]).obj


class MixtureOfLorasLinear(nn.Linear):
    """A frozen ``nn.Linear`` (same ``weight``/``bias``, so the base keys do not change) plus ``num_loras`` LoRA
    experts ``lora_A [N, r, in]``, ``lora_B [N, out, r]`` and a router over them."""

    def __init__(self, base: nn.Linear, num_loras: int, r: int, alpha: float, router: str, top_k: int,
                 num_samples: int = 4):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.num_loras, self.r, self.alpha, self.kind = num_loras, r, float(alpha), router
        self.scale = self.alpha / r
        like = {"dtype": base.weight.dtype, "device": base.weight.device}
        self.lora_A = nn.Parameter(torch.empty(num_loras, r, self.in_features, **like))
        self.lora_B = nn.Parameter(torch.zeros(num_loras, self.out_features, r, **like))
        for a in self.lora_A:  # as LoRA / PEFT: A uniform(+-1/sqrt(in)), B zero (the update starts at zero)
            nn.init.kaiming_uniform_(a, a=5 ** 0.5)
        opts = {"num_samples": num_samples} if router == "remix" else {"norm_topk_prob": True}
        self.router = router_class(router)(self.in_features, num_loras, top_k, **opts).to(**like)
        self.last_routing = None  # the last forward's Routing (detached), for usage statistics

    def init_weights(self, std: float) -> None:
        """As at construction: A uniform(+-1/sqrt(in)), B zero (a missing LoRA starts as no update)."""
        if not getattr(self.lora_A, "_is_hf_initialized", False):
            for a in self.lora_A:
                nn.init.kaiming_uniform_(a, a=5 ** 0.5)
        init.zeros_(self.lora_B)

    def zoo_spec(self) -> dict:
        spec = {"adapter": MixtureOfLoras.name, "num_loras": self.num_loras, "r": self.r, "alpha": self.alpha,
                "router": self.kind, "top_k": self.router.top_k}
        if self.kind == "remix":
            spec["num_samples"] = self.router.num_samples
        return spec

    def gates(self, x: torch.Tensor) -> torch.Tensor:
        """[T, N] routing weight of each LoRA per token (0 where not selected)."""
        # forward(), not __call__: transformers records every Router call's logits as the MoE layers'
        # router_logits (for the balance loss), and these routers are not MoE layers.
        routing = self.router.forward(x)
        self.last_routing = type(routing)(*(t.detach() if t is not None else None for t in routing))
        zeros = torch.zeros(x.shape[0], self.num_loras, dtype=routing.weights.dtype, device=x.device)
        return zeros.scatter_add(1, routing.indices, routing.weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, self.in_features)
        gate = self.gates(flat)
        # All N LoRAs as one rank N*r projection, each LoRA's r rows scaled by its gate (0 when not selected):
        # for small N*r this is two matmuls, cheaper than gathering each token's factors.
        low = F.linear(flat, self.lora_A.reshape(-1, self.in_features).to(x.dtype))  # [T, N*r]
        low = (low.view(-1, self.num_loras, self.r) * gate.to(low.dtype)[..., None]).reshape(low.shape)
        up = self.lora_B.permute(1, 0, 2).reshape(self.out_features, -1).to(x.dtype)  # [out, N*r]
        return y + self.scale * F.linear(low, up).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, loras={self.num_loras}, r={self.r}, "
                f"alpha={self.alpha}, router={self.kind}")


class MixtureOfLoras(Adapter):
    name = "mixture-of-loras"
    summary = "N LoRA experts per targeted linear layer, routed per token by a learned softmax or a ReMix router."
    paper = ("Zadouri et al., Pushing Mixture of Experts to the Limit: Extremely Parameter Efficient MoE for "
             "Instruction Tuning (MoLoRA), ICLR 2024, arXiv:2309.05444; Qiu et al., ReMix: Reinforcement routing "
             "for mixtures of LoRAs in LLM finetuning, 2026, arXiv:2603.10160")
    card = "cards/mixture-of-loras.md"
    space = "adapter-lab"

    @classmethod
    def demo_controls(cls, model=None):
        return [Control("num_loras", "int", 8, low=2, high=16, step=1, help="LoRAs per linear layer"),
                Control("r", "int", 8, low=1, high=64, step=1, help="rank of each LoRA"),
                Control("alpha", "float", 16.0, low=1.0, high=128.0, step=1.0, help="LoRA scale numerator"),
                Control("router", "choice", "remix", choices=tuple(ROUTERS), help="how LoRAs are picked"),
                Control("top_k", "int", 2, low=1, high=8, step=1, help="LoRAs per token (at most num_loras)"),
                Control("target", "text", ATTENTION, help="linear layers adapted (comma list)")]

    @classmethod
    def demo_presets(cls, model=None):
        return {"mild": {"num_loras": 8, "r": 4, "top_k": 2}, "strong": {"num_loras": 8, "r": 8, "top_k": 2,
                                                                      "router": "learned"}}

    def __init__(self, num_loras: int = 8, r: int = 8, alpha: float = 16.0, router: str = "remix", top_k: int = 2,
                 target: str = ATTENTION, num_samples: int = 4):
        super().__init__(num_loras=num_loras, r=r, alpha=alpha, router=router, top_k=top_k, target=target,
                         num_samples=num_samples)
        self.num_loras = check_int("num_loras", num_loras, 1)
        self.r = check_int("r", r, 1)
        self.alpha = check_float("alpha", alpha, 1e-12)
        if router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
        self.router = router
        self.top_k = check_int("top_k", top_k, 1, num_loras)
        self.targets = parse_target(target)
        self.num_samples = check_int("num_samples", num_samples, 2)

    def module_options(self) -> dict:
        return {"num_loras": self.num_loras, "r": self.r, "alpha": self.alpha, "router": self.router,
                "top_k": self.top_k, "num_samples": self.num_samples}

    def attach(self, model):
        found = find_linears(model, self.targets, self.name)
        built = [(path, MixtureOfLorasLinear(linear, **self.module_options())) for path, linear in found]
        swap(model, built)
        return model

    @classmethod
    def build_module(cls, linear: nn.Linear, spec: dict) -> MixtureOfLorasLinear:
        """The empty module ``config.zoo_modules`` describes (``zoo.moe.layout.apply_modules`` calls this on load)."""
        return MixtureOfLorasLinear(linear, **{k: v for k, v in spec.items() if k != "adapter"})

    def loss(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """``(loss to backpropagate, supervised loss)`` for one training batch [B, L]: ReMix's RLOO loss over
        ``num_samples`` draws per sequence, or the plain LM loss for the learned router."""
        if self.router == "remix":
            out = sys.modules[router_class("remix").__module__].rloo_loss(model, input_ids, attention_mask,
                                                                           self.num_samples)
            return out.loss, out.lm_loss
        labels = input_ids if attention_mask is None else input_ids.masked_fill(attention_mask == 0, -100)
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        return loss, loss


def mixture_modules(model) -> list[tuple[str, MixtureOfLorasLinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MixtureOfLorasLinear)]
