"""First-party architectures: six families with specs of their own, and every other MoE family transformers ships
through the generic adapter (``zoo.architectures.families``), registered through ``register_architectures``."""
from zoo.hookspecs import hookimpl


@hookimpl
def register_architectures(register):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from zoo.architectures.deepseek_v3 import DeepseekV3
    from zoo.architectures.families import GENERIC
    from zoo.architectures.generic import GenericFamily
    from zoo.architectures.cohere2_moe import Cohere2Moe
    from zoo.architectures.llama4 import Llama4Text
    from zoo.model_entries import GENERIC_PUBLIC

    SPECS = {"llama4_text": Llama4Text, "cohere2_moe": Cohere2Moe}  # generic families with a small spec of their own
    from zoo.architectures.gpt_oss import GptOss
    from zoo.architectures.mixtral import Mixtral
    from zoo.architectures.olmoe import Olmoe
    from zoo.architectures.qwen2_moe import Qwen2Moe
    from zoo.architectures.qwen3_moe import Qwen3Moe

    for family in (Mixtral(), Qwen2Moe(), Qwen3Moe(), Olmoe(), DeepseekV3(), GptOss()):
        register(family)
    papers = {entry.family: entry.paper for entry in GENERIC_PUBLIC}  # the papers of their public checkpoints
    for model_type, auto in GENERIC.items():
        if model_type in CONFIG_MAPPING_NAMES:  # an older transformers may lack some
            register(SPECS[model_type]() if model_type in SPECS
                     else GenericFamily(model_type, auto, paper=papers.get(model_type, "")))


@hookimpl
def register_experts(register):
    from zoo.moe import SwiGLUExperts
    from zoo.moe.experts import MLPExperts
    from zoo.moe.channel_topk import ChannelTopKExperts
    from zoo.moe.factored import FactoredExperts
    from zoo.moe.quantized import QuantizedExperts

    register(SwiGLUExperts)
    register(MLPExperts)
    register(QuantizedExperts)
    register(ChannelTopKExperts)
    register(FactoredExperts)
