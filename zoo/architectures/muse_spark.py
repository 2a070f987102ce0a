"""Muse Spark: a latent MoE. Each MoE block routes on the residual (fp32 logits times ``output_multiplier``, a
sigmoid, a selection-only bias, renormalised and scaled: ``scored-topk`` with ``logit_scale``), while its experts
work in a narrower space: the input is projected (``pre_expert_proj``, H -> M) and normed (``pre_expert_norm``,
an offset RMS norm), each expert's output is normed (``post_expert_norm``: the offset weight scales the input of the
norm) before its routing weight scales it, and the weighted sum is projected back (``post_expert_proj``, M -> H).
The zoo block holds each as a part of its own: ``input_proj``, ``input_norm``, ``expert_output_norm``,
``output_proj`` (``zoo.moe.block_parts``), so routers, compressors and the quantizer act on the latent experts
and carry the projections and norms along.

The native model is vision-language (``MuseSparkForConditionalGeneration``: a vision and an audio tower beside the
language model); the language model's MoE blocks convert, the towers stay. Export writes the native format back as
long as every MoE layer keeps one expert count, k and the native parts.
"""
from __future__ import annotations

from zoo.architectures.family import NotConvertible
from zoo.architectures.generic import RenamedBlockFamily, activation_name, recorded_entry

# native key (below the block) -> zoo key
RENAMES = {"gate.weight": "router.weight", "gate.e_score_correction_bias": "router.e_score_correction_bias",
           "pre_expert_proj.weight": "input_proj.weight", "pre_expert_norm.weight": "input_norm.weight",
           "experts.gate_up_proj": "experts.gate_up_proj", "experts.down_proj": "experts.down_proj",
           "experts.post_expert_norm.weight": "expert_output_norm.weight", "post_expert_proj.weight": "output_proj.weight"}


class MuseSpark(RenamedBlockFamily):
    renames, label = RENAMES, "Muse Spark"

    def __init__(self):
        super().__init__("muse_spark", "image-text-to-text",
                         summary="Muse Spark vision-language model (latent MoE: experts in a narrower space between "
                                 "an input and an output projection, each expert's output normed; sigmoid top-k "
                                 "routing with a selection bias).",
                         paper="")

    def discover(self, base) -> None:
        from transformers.models.muse_spark.modeling_muse_spark import MuseSparkMoE

        self.layers_path = "language_model.layers" if hasattr(base, "language_model") else "layers"
        self.block_attr, self.block_class = "mlp", MuseSparkMoE

    @staticmethod
    def read_block(block, config) -> dict:
        return block_entry(block, config)

    def native_values(self, values: dict, first: dict, config) -> dict:
        values["text_config"].update(num_local_experts=first["num_experts"],
                                     num_experts_per_tok=first["num_experts_per_tok"],
                                     moe_intermediate_size=first["experts_options"]["intermediate_size"])
        return values


def block_entry(block, config) -> dict:
    """The layout entry of a native Muse Spark MoE block (shapes only: works on the meta device)."""
    gate, experts = block.gate, block.experts
    E, two_i, M = experts.gate_up_proj.shape
    H = gate.weight.shape[1]
    if block.pre_expert_proj.bias is not None or block.post_expert_proj.bias is not None:
        raise NotConvertible("Muse Spark block with biased projections")
    entry = {"num_experts": E, "num_experts_per_tok": gate.top_k, "router": "scored-topk",
             "router_options": {"score": "sigmoid", "norm_topk_prob": True,
                                "routed_scaling_factor": float(gate.routed_scaling_factor), "selection_bias": True,
                                "n_group": 1, "topk_group": 1, "group_score": "top2", "logit_softcap": 0.0,
                                "bias_on": "scores", "bias": False, "logit_scale": float(gate.output_multiplier)},
             "experts": "swiglu",
             "experts_options": {"num_experts": E, "hidden_size": M, "intermediate_size": two_i // 2, "bias": False,
                                 "activation": activation_name(experts.act_fn, config)},
             "shared_experts": None, "returns_router_scores": False,
             "input_proj": {"in_features": H, "out_features": M},
             "input_norm": {"hidden_size": M, "eps": float(block.pre_expert_norm.eps), "style": "offset-in-dtype"},
             "expert_output_norm": {"hidden_size": M, "eps": float(experts.post_expert_norm.eps),
                                    "style": "input-offset"},
             "output_proj": {"in_features": M, "out_features": H}}
    return recorded_entry(entry, "Muse Spark")
