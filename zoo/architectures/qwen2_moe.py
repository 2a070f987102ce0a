"""Qwen2-MoE: softmax top-k router plus a sigmoid-gated shared expert; some layers may stay dense."""
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

from zoo.architectures.family import Family


def sparse_layer_ids(config):
    """Qwen's rule: MoE where not listed in mlp_only_layers and on every decoder_sparse_step-th layer."""
    dense = set(config.mlp_only_layers or [])
    return [i for i in range(config.num_hidden_layers)
            if i not in dense and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0]


class Qwen2Moe(Family):
    name = "qwen2_moe"
    summary = "Qwen2-MoE / Qwen1.5-MoE decoder (softmax top-k, gated shared expert)."
    paper = "Qwen Team, Qwen1.5-MoE: Matching 7B Model Performance with 1/3 Activated Parameters, 2024"
    config_class, model_class, block_class = Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen2MoeSparseMoeBlock
    renames = {"gate.": "router.", "shared_expert_gate.": "shared_experts.gate.", "shared_expert.": "shared_experts."}

    def moe_layer_ids(self, config):
        return sparse_layer_ids(config)

    def shared_options(self, config):
        return {"hidden_size": config.hidden_size, "intermediate_size": config.shared_expert_intermediate_size,
                "gated": True}
