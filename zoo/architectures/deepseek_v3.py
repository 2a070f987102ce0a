"""DeepSeek-V3: sigmoid affinities, bias-corrected group-limited selection, shared experts, dense first layers."""
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

from zoo.architectures.family import Family


class DeepseekV3(Family):
    name = "deepseek_v3"
    summary = "DeepSeek-V3 decoder (sigmoid + bias routing, group-limited top-k, shared experts)."
    paper = "DeepSeek-AI, DeepSeek-V3 Technical Report, 2024. arXiv:2412.19437"
    config_class, model_class, block_class = DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV3MoE
    num_experts_key = "n_routed_experts"
    router = "sigmoid-bias"
    router_config_keys = ("n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor")
    aux_loss = False  # balance comes from the selection bias, not from a loss
    keep_in_fp32 = ["e_score_correction_bias", "router.weight"]

    def moe_layer_ids(self, config):
        return list(range(config.first_k_dense_replace, config.num_hidden_layers))

    def shared_options(self, config):
        return {"hidden_size": config.hidden_size,
                "intermediate_size": config.moe_intermediate_size * config.n_shared_experts, "gated": False}
