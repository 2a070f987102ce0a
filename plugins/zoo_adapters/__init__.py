"""First-party adapters: LoRA on experts, mixtures of LoRAs, and dense <-> MoE structure changes."""
from zoo import hookimpl


@hookimpl
def register_adapters(register):
    from zoo_adapters.ewa import Ewa
    from zoo_adapters.moefy import Moefy
    from zoo_adapters.upcycle import Upcycle

    register(Upcycle)
    register(Ewa)
    register(Moefy)
