"""moefy: Dynamic-DINO's granularity decomposition with its pre-trained weight allocation and router
initialisation. A dense decoder becomes the zoo model of its MoE sibling family (see ``zoo_adapters.upcycle``:
Llama/Mistral -> Mixtral, Qwen2 -> Qwen2-MoE, Qwen3 -> Qwen3-MoE, OLMo 2 -> FlexOlmo) whose experts are
slices of each FFN's intermediate channels (their rows of gate_proj / up_proj, their columns of down_proj).

``init="grouped"`` (the default; our reading of the paper's allocation and router initialisation): the FFN is cut
into ``top_k`` pieces of I/k channels and the E experts are E/k copies of that k-way split, expert e holding piece
``e % k``; the k experts of one copy (a group) share one router row. Top-k then always selects one whole group
(k tied logits), Mixtral-style renormalisation gives each 1/k, and each expert's down_proj carries a factor k,
so at init every token gets exactly the dense FFN (up to rounding), for any ``top_k < num_experts``. Training
unties the rows and the copies, so tokens start mixing pieces from different groups.

``init="split"`` (the zoo's earlier variant): E slices of I/E channels each, down_proj scaled by E; lossless only
with ``top_k = num_experts`` (zero router, weight 1/E each); with a smaller top-k the router starts from
N(0, initializer_range^2) and the chosen slices stand in for the whole FFN (E/k times each) until training.
"""
from __future__ import annotations

import torch

from zoo import Adapter
from zoo.components.options import check_float, check_int
from zoo_adapters.upcycle import dense_mlps, ffn_weights, to_sibling
from zoo.components.controls import Control

INITS = ("grouped", "split")


class Moefy(Adapter):
    name = "moefy"
    summary = ("Dynamic-DINO granularity decomposition: split each dense FFN into fine-grained experts, "
               "grouped so the top-k start as the dense FFN.")
    paper = ("Lu et al., Dynamic-DINO: Fine-Grained Mixture of Experts Tuning for Real-time Open-Vocabulary "
             "Object Detection, ICCV 2025, arXiv:2507.17436")
    card = "cards/moefy.md"
    space = "model-zoo"
    accepts_dense = True  # zoo.apply passes the dense model as it is (no zoo.convert first)

    @classmethod
    def demo_controls(cls, model=None):
        return [Control("num_experts", "choice", 8, choices=(2, 4, 8, 16), help="experts the FFN is split into"),
                Control("top_k", "choice", 2, choices=(1, 2), help="experts per token (grouped: pieces per FFN)"),
                Control("init", "choice", "grouped", choices=INITS,
                        help="grouped: E/k copies of a k-way split (the paper's, lossless); split: E slices")]

    @classmethod
    def demo_presets(cls, model=None):
        return {"mild": {"num_experts": 4, "top_k": 2}, "strong": {"num_experts": 8, "top_k": 2}}

    def __init__(self, num_experts: int = 8, top_k: int | None = 2, init: str = "grouped", seed: int = 0,
                 router_aux_loss_coef: float = 0.01):
        super().__init__(num_experts=num_experts, top_k=top_k, init=init, seed=seed,
                         router_aux_loss_coef=router_aux_loss_coef)
        self.num_experts = check_int("num_experts", num_experts, 1)
        self.top_k = num_experts if top_k is None else check_int("top_k", top_k, 1, num_experts)
        if init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {init!r}")
        if init == "grouped" and num_experts % self.top_k:
            raise ValueError(f"init='grouped': top_k={self.top_k} must divide num_experts={num_experts} "
                             "(the experts are num_experts/top_k copies of a top_k-way split)")
        self.init = init
        self.seed = check_int("seed", seed, 0)
        self.router_aux_loss_coef = check_float("router_aux_loss_coef", router_aux_loss_coef, 0.0)
        self.results = {}

    @torch.no_grad()
    def attach(self, model):
        mlps = dense_mlps(model, self.name)
        E, k, H = self.num_experts, self.top_k, model.config.hidden_size
        I = mlps[0].down_proj.weight.shape[1]
        pieces = k if self.init == "grouped" else E
        if I % pieces:
            raise ValueError(f"{'top_k' if self.init == 'grouped' else 'num_experts'}={pieces} must divide the FFN's "
                             f"intermediate size {I}")
        g = torch.Generator().manual_seed(self.seed)
        std = model.config.initializer_range
        if self.init == "grouped":
            self.results = {"init": "grouped", "groups": E // k, "expert_intermediate_size": I // k,
                            "router_init": f"one N(0, {std}^2) row per group of {k} experts (tied)"}
        else:
            std = 0.0 if k == E else std
            self.results = {"init": "split", "expert_intermediate_size": I // E,
                            "router_init": "zeros (uniform weights)" if std == 0 else f"random N(0, {std}^2)"}
        blocks = []
        for mlp in mlps:
            gate_up, down = ffn_weights(mlp)
            gate, up = gate_up.chunk(2)  # [I, H] each
            n = I // pieces
            split_gate_up = torch.cat([gate.reshape(pieces, n, H), up.reshape(pieces, n, H)], dim=1)  # [p, 2n, H]
            split_down = down.reshape(H, pieces, n).transpose(0, 1) * pieces  # [p, H, n]
            if self.init == "grouped":
                piece = torch.arange(E) % k  # expert e holds piece e % k; group e // k
                gate_up, down = split_gate_up[piece], split_down[piece]
                router = (torch.randn(E // k, H, generator=g) * std).repeat_interleave(k, dim=0)
            else:
                gate_up, down = split_gate_up, split_down
                router = torch.randn(E, H, generator=g) * std
            blocks.append((router.to(gate_up.dtype), gate_up.contiguous(), down.contiguous()))
        return to_sibling(model, blocks, k, self.router_aux_loss_coef)
