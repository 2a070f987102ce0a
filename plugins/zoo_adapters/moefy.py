"""moefy: Dynamic-DINO's granularity decomposition. A dense Mistral model becomes a zoo Mixtral model whose
experts are slices of each FFN: expert e owns intermediate channels [e*I/E, (e+1)*I/E), i.e. its rows of
gate_proj / up_proj and its columns of down_proj, so the sum of all experts is the FFN.

Mixtral's router renormalises the kept weights to sum to 1, so each expert's down_proj is scaled by E and the
router starts at zero: with ``top_k = num_experts`` every token gets weight 1/E on each expert, and
E * (1/E) * slice summed over the slices is the dense FFN again (exact in float for E a power of two, else
within rounding). With a smaller ``top_k`` the chosen slices are scaled up (E/k on average), and a zero router
would tie, so the router starts from N(0, initializer_range²) instead.
"""
from __future__ import annotations

import torch

from zoo import Adapter
from zoo.options import check_float, check_int
from zoo_adapters.upcycle import dense_mlps, ffn_weights, to_mixtral
from zoo.demo_controls import Control


class Moefy(Adapter):
    name = "moefy"
    summary = "Dynamic-DINO granularity decomposition: split each dense FFN's channels into E fine-grained experts."
    paper = ("Lu et al., Dynamic-DINO: Fine-Grained Mixture of Experts Tuning for Real-time Open-Vocabulary "
             "Object Detection, ICCV 2025, arXiv:2507.17436")
    card = "cards/moefy.md"
    space = "model-zoo"
    accepts_dense = True  # zoo.apply passes the dense model as it is (no zoo.convert first)

    @classmethod
    def demo_controls(cls, model=None):
        return [Control("num_experts", "choice", 8, choices=(2, 4, 8, 16), help="experts the FFN is split into"),
                Control("top_k", "int", None, low=1, high=2, step=1, optional=True,
                        help="experts per token (empty: all)")]

    @classmethod
    def demo_presets(cls, model=None):
        return {"mild": {"num_experts": 4, "top_k": 2}, "strong": {"num_experts": 8, "top_k": 2}}

    def __init__(self, num_experts: int = 8, top_k: int | None = None, seed: int = 0,
                 router_aux_loss_coef: float = 0.01):
        super().__init__(num_experts=num_experts, top_k=top_k, seed=seed, router_aux_loss_coef=router_aux_loss_coef)
        self.num_experts = check_int("num_experts", num_experts, 1)
        self.top_k = num_experts if top_k is None else check_int("top_k", top_k, 1, num_experts)
        self.seed = check_int("seed", seed, 0)
        self.router_aux_loss_coef = check_float("router_aux_loss_coef", router_aux_loss_coef, 0.0)
        self.results = {}

    @torch.no_grad()
    def attach(self, model):
        mlps = dense_mlps(model, self.name)
        E, H, I = self.num_experts, model.config.hidden_size, model.config.intermediate_size
        if I % E:
            raise ValueError(f"num_experts={E} must divide the FFN's intermediate size {I}")
        g = torch.Generator().manual_seed(self.seed)
        std = 0.0 if self.top_k == E else model.config.initializer_range
        self.results = {"router_init": "zeros (uniform weights)" if std == 0 else f"random N(0, {std}^2)",
                        "expert_intermediate_size": I // E}
        blocks = []
        for mlp in mlps:
            gate_up, down = ffn_weights(mlp)
            gate, up = gate_up.chunk(2)  # [I, H] each
            gate_up = torch.cat([gate.reshape(E, I // E, H), up.reshape(E, I // E, H)], dim=1)  # [E, 2I/E, H]
            down = down.reshape(H, E, I // E).transpose(0, 1) * E  # [E, H, I/E]
            router = torch.randn(E, H, generator=g) * std
            blocks.append((router.to(gate_up.dtype), gate_up.contiguous(), down.contiguous()))
        return to_mixtral(model, blocks, self.top_k, self.router_aux_loss_coef)
