"""LongCat-Flash: each decoder layer holds two attention and two dense MLP sublayers, and one MoE block as a shortcut:
the block reads the output of the first post-attention norm and its output is added at the layer's end. The block
sits at the layer's ``mlp`` and is called on that normed input alone, so the zoo block takes its place as it is.

Its router scores all ``n_routed_experts + zero_expert_num`` rows by a softmax of fp32 logits (the classifier's
bias, where one is stored, is never read), picks the top k of the scores plus a selection-only bias, and weighs
each pick by its unbiased score times ``routed_scaling_factor`` (no renormalisation): ``scored-topk`` with
``score="softmax"``, ``selection_bias``, ``norm_topk_prob=False``. Rows from ``n_routed_experts`` up are
zero-computation experts: a token routed there gets the block's input times the weight, which the zoo block holds as
``identity_experts``.

The native ``experts.gate_up_proj`` has a row per router row, identity experts included, though only the first
``n_routed_experts`` are ever read: conversion drops the identity experts' rows (they change nothing), and export
writes zeros in their place. Export gives back the native layout as long as every layer has the same experts, k,
identity experts and routing rule (a pruned model exports with fewer ``n_routed_experts``, its identity experts
kept).
"""
from __future__ import annotations


import torch

from zoo.architectures.family import NotConvertible
from zoo.architectures.generic import RenamedBlockFamily, activation_name, recorded_entry

# native key (below the block) -> zoo key
RENAMES = {"router.classifier.weight": "router.weight",
           "router.e_score_correction_bias": "router.e_score_correction_bias",
           "experts.gate_up_proj": "experts.gate_up_proj", "experts.down_proj": "experts.down_proj"}


class LongcatFlash(RenamedBlockFamily):
    renames, label = RENAMES, "LongCat-Flash"
    def __init__(self):
        super().__init__("longcat_flash", "causal-lm",
                         summary="LongCat-Flash decoder (two attention/MLP sublayers per layer, a shortcut MoE block "
                                 "with zero-computation experts beside its FFN experts, softmax top-k routing with a "
                                 "selection bias).",
                         paper="Meituan LongCat Team, LongCat-Flash Technical Report, 2025. arXiv:2509.01322")

    # ---- where the blocks are -------------------------------------------------------------------------------
    def discover(self, base) -> None:
        from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashMoE

        self.layers_path, self.block_attr, self.block_class = "layers", "mlp", LongcatFlashMoE

    # ---- one block ------------------------------------------------------------------------------------------
    @staticmethod
    def read_block(block, config) -> dict:
        return block_entry(block, config)

    def to_zoo_state(self, sd: dict) -> dict:
        out = super().to_zoo_state(sd)
        experts = sd["experts.down_proj"].shape[0]
        out["experts.gate_up_proj"] = sd["experts.gate_up_proj"][:experts]  # identity experts' rows: never read
        return out

    def to_native_state(self, sd: dict) -> dict:
        out = super().to_native_state(sd)
        gate_up = sd["experts.gate_up_proj"]
        identity = sd["router.weight"].shape[0] - gate_up.shape[0]
        out["experts.gate_up_proj"] = torch.cat([gate_up, gate_up.new_zeros(identity, *gate_up.shape[1:])])
        return out

    # ---- export -----------------------------------------------------------------------------------------------
    def native_values(self, values: dict, first: dict, config) -> dict:
        values.update(n_routed_experts=first["num_experts"], moe_topk=first["num_experts_per_tok"],
                      zero_expert_num=first.get("identity_experts", 0),
                      expert_ffn_hidden_size=first["experts_options"].get("intermediate_size"))
        return values


def block_entry(block, config) -> dict:
    """The layout entry of a native LongCat-Flash MoE block (shapes only: works on the meta device)."""
    experts, router = block.experts, block.router
    if experts.gate_up_proj is None:
        raise NotConvertible("LongCat-Flash with n_routed_experts=0: a block of identity experts alone")
    if router.classifier.bias is not None:
        raise NotConvertible("LongCat-Flash with router_bias: its router stores a classifier bias it never reads")
    H = experts.hidden_size
    entry = {"num_experts": experts.num_routed_experts, "num_experts_per_tok": router.top_k, "router": "scored-topk",
             "router_options": {"score": "softmax", "norm_topk_prob": False,
                                "routed_scaling_factor": float(router.routed_scaling_factor), "selection_bias": True,
                                "n_group": 1, "topk_group": 1, "group_score": "top2", "logit_softcap": 0.0,
                                "bias_on": "scores", "bias": False},
             "experts": "swiglu",
             "experts_options": {"num_experts": experts.num_routed_experts, "hidden_size": H,
                                 "intermediate_size": experts.intermediate_size, "bias": False,
                                 "activation": activation_name(experts.act_fn, config)},
             "shared_experts": None, "returns_router_scores": False,
             **({"identity_experts": experts.zero_expert_num} if experts.zero_expert_num else {})}
    return recorded_entry(entry, "LongCat-Flash")
