"""Mixtral: softmax top-k router that always renormalises the kept weights."""
from transformers import MixtralConfig, MixtralForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

from zoo.architectures.family import Family


class Mixtral(Family):
    name = "mixtral"
    summary = "Mixtral sparse MoE decoder (softmax top-k, renormalised)."
    paper = "Jiang et al., Mixtral of Experts, 2024. arXiv:2401.04088"
    config_class, model_class, block_class = MixtralConfig, MixtralForCausalLM, MixtralSparseMoeBlock
    num_experts_key, intermediate_key = "num_local_experts", "intermediate_size"
    router_config_keys = ()

    def router_options(self, config):
        return {"norm_topk_prob": True}
