"""Zaya (Zyphra's ZAYA1): every decoder layer holds one MoE block, and the blocks' routers talk to each other. A
router projects its block's input down to ``router_hidden_size``, adds the router state the previous layer's router
handed on (scaled per channel; the first layer has none to add) and hands the sum on to the next layer; an MLP over
that state scores the experts and one more class, a skip class whose pick computes nothing. The native model threads
the state through its layers: the decoder layer calls ``mlp(hidden_states, prev_router_hidden_states)`` and gets
``(output, state)`` back, and the model's loop hands the state to the next layer.

The zoo block keeps that call (``carries_router_state``: called with the previous state, it returns its output and
the next state) and its router is ``zaya-mlp`` (``zoo_routers.zaya_mlp``): the skip class is an empty slot (index
E, weight 0), its output row and selection bias are held apart from the experts' so that pruning and merging keep
them. The first layer's router reads no state (``reads_state=False``: no ``router_states_scale``), so its layout
entry differs from the others' in that option. The layer-at-a-time engine hands a compressor the state each
calibration token's block was handed (through the routing context), so layer statistics route as the model does.
The experts are transformers' fused SwiGLU experts; the residual scaling, CCA attention and the rest stay native.

Export writes Zaya's own layout back (the skip row after the experts' rows of ``out_proj``, its bias after theirs in
``balancing_biases``) as long as every layer has the same experts and k, and each router is Zaya's. Conversion,
export and steps that need no calibration stream from shards; a calibrated step streamed is refused (the layers
take the state as a positional input, which the engine records from the model in memory). Note: transformers 5.24
sets the skip class's selection bias to -1 whenever it loads a native checkpoint (its weight init writes it
unguarded), so a native model loaded by transformers has -1 there whatever was saved; a streamed conversion reads
the stored value.
"""
from __future__ import annotations

import json

import torch

from zoo.architectures.family import NotExportable
from zoo.architectures.generic import GenericFamily, RenamedBlockFamily, activation_name, recorded_entry

# native key (below the block) -> zoo key; out_proj and balancing_biases hold the skip class after the experts
RENAMES = {"gate.down_proj.weight": "router.down_proj.weight", "gate.down_proj.bias": "router.down_proj.bias",
           "gate.router_states_scale": "router.router_states_scale",
           "gate.router_mlp.norm.weight": "router.norm.weight",
           "gate.router_mlp.fc1.weight": "router.fc1.weight", "gate.router_mlp.fc1.bias": "router.fc1.bias",
           "gate.router_mlp.fc2.weight": "router.fc2.weight", "gate.router_mlp.fc2.bias": "router.fc2.bias",
           "experts.gate_up_proj": "experts.gate_up_proj", "experts.down_proj": "experts.down_proj"}
SPLIT = {"gate.router_mlp.out_proj.weight": ("router.weight", "router.skip_weight"),
         "gate.balancing_biases": ("router.balancing_bias", "router.skip_bias")}


class Zaya(RenamedBlockFamily):
    renames, label = RENAMES, "Zaya"

    def __init__(self):
        super().__init__("zaya", "causal-lm",
                         summary="Zaya decoder (CCA attention, learned residual scaling; an MLP router per MoE block "
                                 "that carries a state from layer to layer and has a skip class).",
                         paper="Zyphra, ZAYA1-8B Technical Report, 2026. arXiv:2605.05365")

    # ---- where the blocks are -------------------------------------------------------------------------------
    def discover(self, base) -> None:
        from transformers.models.zaya.modeling_zaya import ZayaSparseMoeBlock

        self.layers_path, self.block_attr, self.block_class = "layers", "mlp", ZayaSparseMoeBlock

    # ---- one block ------------------------------------------------------------------------------------------
    def spec(self, block, config) -> dict:
        """One spec per config and kind of router (the first layer's reads no state)."""
        text = self.text_config(config)
        key = json.dumps([text.to_dict(), block.gate.use_eda], sort_keys=True, default=str)
        if key not in self._specs:
            self._specs[key] = {"entry": block_entry(block, text)}
        return self._specs[key]

    def to_zoo_state(self, sd: dict) -> dict:
        out = super().to_zoo_state({k: v for k, v in sd.items() if k not in SPLIT})
        for key, (experts, skip) in SPLIT.items():
            if key in sd:
                out[experts], out[skip] = sd[key][:-1], sd[key][-1:]
        return out

    def to_native_state(self, sd: dict) -> dict:
        split = {k for pair in SPLIT.values() for k in pair}
        out = super().to_native_state({k: v for k, v in sd.items() if k not in split})
        for key, (experts, skip) in SPLIT.items():
            if experts in sd or skip in sd:
                if experts not in sd or skip not in sd:
                    raise NotExportable(f"a native Zaya block needs {experts} and {skip} together")
                out[key] = torch.cat([sd[experts], sd[skip]])
        return out

    # ---- export -----------------------------------------------------------------------------------------------
    def native_config(self, config, layout):
        # each layer against the native block at that layer: the first one's router reads no state
        return GenericFamily.native_config(self, config, layout)


def block_entry(block, config) -> dict:
    """The layout entry of a native Zaya MoE block (shapes only: works on the meta device)."""
    gate, experts = block.gate, block.experts
    entry = {"num_experts": experts.num_experts, "num_experts_per_tok": gate.top_k, "router": "zaya-mlp",
             "router_options": {"router_hidden_size": gate.router_hidden_size, "reads_state": gate.use_eda,
                                "eps": float(gate.router_mlp.norm.variance_epsilon), "bias": False},
             "experts": "swiglu",
             "experts_options": {"num_experts": experts.num_experts, "hidden_size": experts.hidden_dim,
                                 "intermediate_size": experts.intermediate_dim, "bias": False,
                                 "activation": activation_name(experts.act_fn, config)},
             "shared_experts": None, "returns_router_scores": False, "carries_router_state": True}
    return recorded_entry(entry, "Zaya")
