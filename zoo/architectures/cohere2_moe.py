"""Cohere2-MoE: what the generic adapter cannot see from the routing alone. With
``shared_expert_combination_strategy="average"`` the block returns ``(routed + shared) / 2``: the zoo block
holds that as routing weights scaled by 0.5 (``scored-topk``) and a shared MLP scaled by 0.5."""
import copy

from zoo.architectures.generic import GenericFamily


def _halve_routing(router: str, options: dict) -> tuple[str, dict]:
    if router == "topk-softmax":
        options = {"score": "softmax", "norm_topk_prob": options["norm_topk_prob"], "routed_scaling_factor": 1.0,
                   "selection_bias": False, "n_group": 1, "topk_group": 1, "group_score": "top2",
                   "logit_softcap": 0.0, "bias_on": "scores", "bias": options["bias"]}
        router = "scored-topk"
    if "routed_scaling_factor" not in options:
        raise ValueError(f"{router} routing cannot be scaled")
    return router, {**options, "routed_scaling_factor": options["routed_scaling_factor"] * 0.5}


class Cohere2Moe(GenericFamily):
    def __init__(self):
        super().__init__("cohere2_moe", "causal-lm", summary="Cohere2-MoE decoder (softmax top-k, shared experts "
                         "summed or averaged with the routed ones).")

    def spec(self, block, config) -> dict:
        spec = super().spec(block, config)
        text = self.text_config(config)
        if getattr(text, "shared_expert_combination_strategy", "sum") != "average" or spec.get("averaged"):
            return spec
        entry = copy.deepcopy(spec["entry"])
        if entry["shared_experts"] is not None:
            entry["router"], entry["router_options"] = _halve_routing(entry["router"], entry["router_options"])
            entry["shared_experts"]["scale"] = 0.5
        spec.update(entry=entry, averaged=True)
        return spec
