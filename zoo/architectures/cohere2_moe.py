"""Cohere2-MoE: what the generic adapter cannot read off the block. With
``shared_expert_combination_strategy="average"`` the block returns ``(routed + shared) / 2``: the generic
probe finds the routed half (routing weights scaled by 0.5); this spec halves the shared MLP."""
import copy

from zoo.architectures.generic import GenericFamily


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
            entry["shared_experts"]["scale"] = 0.5
        spec.update(entry=entry, averaged=True)
        return spec
