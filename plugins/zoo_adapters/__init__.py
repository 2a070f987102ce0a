"""First-party adapters: LoRA on experts, mixtures of LoRAs, and dense <-> MoE structure changes."""
from zoo import hookimpl


@hookimpl
def register_adapters(register):
    from zoo_adapters.ewa import Ewa
    from zoo_adapters.lora_experts import LoraExperts
    from zoo_adapters.mixture_of_loras import MixtureOfLoras
    from zoo_adapters.moefy import Moefy
    from zoo_adapters.replora import RepLora
    from zoo_adapters.roma import Roma
    from zoo_adapters.ubmoe import Ubmoe
    from zoo_adapters.upcycle import Upcycle
    from zoo_adapters.zero_init_attention import ZeroInitAttention

    register(Upcycle)
    register(Ewa)
    register(Moefy)
    register(LoraExperts)
    register(MixtureOfLoras)
    register(RepLora)
    register(Roma)
    register(Ubmoe)
    register(ZeroInitAttention)


@hookimpl
def register_experts(register):
    from zoo_adapters.mofme import MofmeExperts

    register(MofmeExperts)
