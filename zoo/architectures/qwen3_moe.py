"""Qwen3-MoE: softmax top-k router (optional renormalisation), no shared expert."""
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from zoo.architectures.family import Family
from zoo.architectures.qwen2_moe import sparse_layer_ids


class Qwen3Moe(Family):
    name = "qwen3_moe"
    summary = "Qwen3-MoE decoder (softmax top-k, fine-grained experts)."
    paper = "Qwen Team, Qwen3 Technical Report, 2025. arXiv:2505.09388"
    config_class, model_class, block_class = Qwen3MoeConfig, Qwen3MoeForCausalLM, Qwen3MoeSparseMoeBlock

    def moe_layer_ids(self, config):
        return sparse_layer_ids(config)
