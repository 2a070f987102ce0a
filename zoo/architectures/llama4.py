"""Llama 4 (text): what the generic adapter cannot read off the block. Its experts are not transformers' fused
experts class (every expert runs on every token, inputs pre-scaled), and the routing weight scales each
expert's *input*: ``shared(x) + sum_k expert_k(sigmoid(logit_k) * x)`` over the top-k logits."""
import json

from zoo.architectures.generic import GenericFamily, activation_name


class Llama4Text(GenericFamily):
    def __init__(self):
        super().__init__("llama4_text", "causal-lm",
                         summary="Llama 4 decoder (sigmoid top-k routing scaling expert inputs, shared expert).",
                         paper="Meta AI, The Llama 4 herd, 2025")

    def discover(self, base) -> None:
        from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

        self.layers_path, self.block_attr, self.block_class = "layers", "feed_forward", Llama4TextMoe

    def spec(self, block, config) -> dict:
        experts, shared = block.experts, block.shared_expert
        E, H, two_i = experts.gate_up_proj.shape
        entry = {
            "num_experts": E, "num_experts_per_tok": block.router.top_k,
            "router": "scored-topk",
            "router_options": {"score": "sigmoid", "norm_topk_prob": False, "routed_scaling_factor": 1.0,
                               "selection_bias": False, "n_group": 1, "topk_group": 1, "group_score": "top2",
                               "logit_softcap": 0.0, "bias_on": "scores", "bias": False},
            "experts": "swiglu",
            "experts_options": {"num_experts": E, "hidden_size": H, "intermediate_size": two_i // 2, "bias": False,
                                "activation": activation_name(experts.act_fn, self.text_config(config))},
            "shared_experts": {"hidden_size": H, "intermediate_size": shared.gate_proj.out_features, "gated": False},
            "returns_router_scores": True,  # the decoder layer unpacks (hidden, router output)
            "weights_scale_input": True,
        }
        renames = {"experts.gate_up_proj": "experts.gate_up_proj", "experts.down_proj": "experts.down_proj",
                   "router.weight": "router.weight",
                   **{f"shared_expert.{p}.weight": f"shared_experts.{p}.weight"
                      for p in ("gate_proj", "up_proj", "down_proj")}}
        # one spec per block shape: export reads the native config's blocks, whose shape a prune may have changed
        key = json.dumps(entry, sort_keys=True)
        return self._specs.setdefault(key, {"entry": entry, "renames": renames, "shapes": {}, "transposed": True})
