"""OLMoE: softmax top-k router without renormalisation by default."""
from transformers import OlmoeConfig, OlmoeForCausalLM
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

from zoo.architectures.family import Family


class Olmoe(Family):
    name = "olmoe"
    summary = "OLMoE decoder (softmax top-k, 64 experts, 8 active)."
    paper = "Muennighoff et al., OLMoE: Open Mixture-of-Experts Language Models, 2024. arXiv:2409.02060"
    config_class, model_class, block_class = OlmoeConfig, OlmoeForCausalLM, OlmoeSparseMoeBlock
    intermediate_key = "intermediate_size"
