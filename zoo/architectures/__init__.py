"""First-party architectures: eight families with specs of their own, and every other MoE family transformers ships
through the generic adapter (``zoo.architectures.families``), registered through ``register_architectures``.
Their ``zoo_<family>`` model types join transformers' Auto classes when the plugins load
(``register_auto_classes``): at the registry's first lookup, or when transformers first looks up a ``zoo_`` model
type (see ``zoo.components.plugins``), so ``AutoModelForCausalLM.from_pretrained`` loads a saved zoo model after a bare
``import zoo``. Importing this package is cheap (the hooks import the families, torch and transformers). The room
imports the MoE core, the components' registry and io's low parts (atomic saves, side files); the card a save
writes comes from publishing."""
from functools import cache

from zoo.hookspecs import hookimpl

__all__ = ["Family", "NotConvertible", "NotExportable", "family_specs", "register_auto_classes"]


def __getattr__(name: str):
    if name in ("Family", "NotConvertible", "NotExportable"):  # zoo.architectures.family imports torch
        from zoo.architectures import family

        return getattr(family, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@cache
def family_specs() -> tuple:
    """The family specs, made once (the registry and the zoo classes share these instances)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from zoo.architectures.cohere2_moe import Cohere2Moe
    from zoo.architectures.dbrx import Dbrx
    from zoo.architectures.deepseek_v3 import DeepseekV3
    from zoo.architectures.deepseek_v4 import DeepseekV4
    from zoo.architectures.diffusion_gemma import DiffusionGemma
    from zoo.architectures.doge import Doge
    from zoo.architectures.ernie4_5_vl import Ernie45VL
    from zoo.architectures.families import GENERIC
    from zoo.architectures.gemma4 import Gemma4
    from zoo.architectures.generic import GenericFamily
    from zoo.architectures.gpt_oss import GptOss
    from zoo.architectures.inkling import Inkling
    from zoo.architectures.jetmoe import Jetmoe
    from zoo.architectures.llama4 import Llama4Text
    from zoo.architectures.llama4_vl import Llama4VL
    from zoo.architectures.longcat_flash import LongcatFlash
    from zoo.architectures.mixtral import Mixtral
    from zoo.architectures.muse_spark import MuseSpark
    from zoo.architectures.olmoe import Olmoe
    from zoo.architectures.qwen2_moe import Qwen2Moe
    from zoo.architectures.qwen3_omni import Qwen3Omni
    from zoo.architectures.qwen3_moe import Qwen3Moe
    from zoo.architectures.switch_transformers import SwitchTransformers
    from zoo.architectures.zaya import Zaya
    from zoo.components.model_entries import GENERIC_PUBLIC

    # generic families with a small spec of their own
    specs = {"llama4_text": Llama4Text, "cohere2_moe": Cohere2Moe, "deepseek_v4": DeepseekV4,
             "gemma4_text": Gemma4, "gemma4": lambda: Gemma4("gemma4", "image-text-to-text"),
             "longcat_flash": LongcatFlash, "jetmoe": Jetmoe, "muse_spark": MuseSpark,
             "diffusion_gemma": DiffusionGemma,
             "inkling_text": Inkling, "inkling_mm_model": lambda: Inkling("inkling_mm_model", "image-text-to-text"),
             "zaya": Zaya, "doge": Doge, "ernie4_5_vl_moe": Ernie45VL, "qwen3_omni_moe": Qwen3Omni,
             "llama4": Llama4VL}
    papers = {entry.family: entry.paper for entry in GENERIC_PUBLIC}  # the papers of their public checkpoints
    generic = [specs[t]() if t in specs else GenericFamily(t, auto, paper=papers.get(t, ""))
               for t, auto in GENERIC.items() if t in CONFIG_MAPPING_NAMES]  # an older transformers may lack some
    return (Mixtral(), Qwen2Moe(), Qwen3Moe(), Olmoe(), DeepseekV3(), GptOss(), Dbrx(), SwitchTransformers(), *generic)


def register_auto_classes() -> None:
    for family in family_specs():
        family.register_auto_classes()


@hookimpl
def register_architectures(register):
    for family in family_specs():
        register(family)


@hookimpl
def register_experts(register):
    from zoo.moe import SwiGLUExperts
    from zoo.moe.experts import MLPExperts
    from zoo.moe.channel_topk import ChannelTopKExperts
    from zoo.moe.factored import FactoredExperts
    from zoo.moe.quantized import QuantizedExperts, QuantizedMLPExperts
    from zoo.moe.quantized_lookup import LookupQuantizedExperts

    register(SwiGLUExperts)
    register(MLPExperts)
    register(QuantizedExperts)
    register(QuantizedMLPExperts)
    register(LookupQuantizedExperts)
    register(ChannelTopKExperts)
    register(FactoredExperts)
