"""First-party adapters: LoRA on experts, mixtures of LoRAs, and dense <-> MoE structure changes."""
from zoo import hookimpl


@hookimpl
def register_adapters(register):
    pass
