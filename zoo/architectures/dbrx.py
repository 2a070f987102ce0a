"""DBRX: softmax top-k router renormalised by a p-norm of the kept weights (``moe_normalize_expert_weights``; None:
not renormalised), GLU experts of its own stored as three [E*I, H] matrices (``w1`` gate, ``v1`` up, ``w2`` down
applied as ``h @ w2``), every layer MoE, its MoE keys in ``config.ffn_config`` and its base model at ``.transformer``.

The router's training-time jitter (``moe_jitter_eps``: the block's input scaled by uniform noise while training) has
no zoo counterpart: inference is exact, training a converted model runs without the jitter."""
import math

import torch
from transformers import DbrxConfig, DbrxForCausalLM
from transformers.models.dbrx.modeling_dbrx import DbrxFFN

from zoo.architectures.family import Family, NotConvertible


class Dbrx(Family):
    name = "dbrx"
    summary = "DBRX decoder (softmax top-k renormalised by a p-norm, GLU experts, every layer MoE)."
    paper = "Databricks Mosaic Research, Introducing DBRX: A New State-of-the-Art Open LLM, 2024"
    config_class, model_class, block_class = DbrxConfig, DbrxForCausalLM, DbrxFFN
    base_attr, layers_path, block_attr = "transformer", "blocks", "ffn"
    router_config_keys = ()
    renames = {"router.layer.": "router."}

    # ---- structure -------------------------------------------------------------------------------
    def router_options(self, config):
        p = config.ffn_config.moe_normalize_expert_weights
        if p is None:
            return {"norm_topk_prob": False}
        if isinstance(p, bool) or not math.isfinite(p) or p <= 0:
            raise NotConvertible(f"moe_normalize_expert_weights={p!r}: the zoo renormalises by a p-norm with a finite "
                                 "p > 0 (or not at all: None)")
        # the kept softmax weights are positive: their 1-norm is their sum
        return {"norm_topk_prob": True} if p == 1 else {"norm_topk_prob": True, "norm_p": float(p)}

    def experts_options(self, config):
        return {"activation": config.ffn_config.ffn_act_fn.get("name", "silu"), "bias": False}

    def aux_loss_coef(self, config):
        return config.ffn_config.moe_loss_weight

    def block_layout(self, config):
        ffn = config.ffn_config
        E = ffn.moe_num_experts
        return {
            "num_experts": E,
            "num_experts_per_tok": ffn.moe_top_k,
            "router": self.router,
            "router_options": {"bias": False, **self.router_options(config)},
            "experts": "swiglu",
            "experts_options": {"num_experts": E, "hidden_size": config.hidden_size,
                                "intermediate_size": ffn.ffn_hidden_size, **self.experts_options(config)},
            "shared_experts": None,
            "returns_router_scores": False,
        }

    def native_moe_values(self, values, count, first):
        options = first["router_options"]
        ffn = {**values["ffn_config"], "moe_num_experts": count, "moe_top_k": first["num_experts_per_tok"],
               "ffn_hidden_size": first["experts_options"].get("intermediate_size"),
               "moe_normalize_expert_weights": options.get("norm_p", 1.0) if options.get("norm_topk_prob") else None}
        if "activation" in first["experts_options"]:
            ffn["ffn_act_fn"] = {**ffn.get("ffn_act_fn", {}), "name": first["experts_options"]["activation"]}
        return {**values, "ffn_config": ffn}

    # ---- weights ---------------------------------------------------------------------------------
    def to_zoo_state(self, sd):
        sd = super().to_zoo_state(sd)
        E = sd["router.weight"].shape[0]
        gate, up, down = (sd.pop(f"experts.mlp.{n}").unflatten(0, (E, -1)) for n in ("w1", "v1", "w2"))
        sd["experts.gate_up_proj"] = torch.cat([gate, up], 1)  # [E, 2I, H]: gate rows, then up rows
        sd["experts.down_proj"] = down.transpose(1, 2).contiguous()  # [E, H, I]
        return sd

    def to_native_state(self, sd):
        sd = super().to_native_state(sd)
        gate, up = sd.pop("experts.gate_up_proj").chunk(2, 1)
        sd["experts.mlp.w1"] = gate.flatten(0, 1).contiguous()
        sd["experts.mlp.v1"] = up.flatten(0, 1).contiguous()
        sd["experts.mlp.w2"] = sd.pop("experts.down_proj").transpose(1, 2).flatten(0, 1).contiguous()
        return sd
