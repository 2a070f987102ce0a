"""Gemma 4 (text, and the language model of the vision-language model): its MoE part sits in the decoder layer
itself, beside a dense MLP. The router (``gemma4-topk``) reads the residual stream; the experts read their own RMS-
normed copy of it (``pre_feedforward_layernorm_2``, the block's ``input_norm``) and their weighted sum is normed again
(``post_feedforward_layernorm_2``, the block's ``output_norm``). So the zoo holds it as one ``SparseMoE`` at the
layer's ``moe`` attribute, called on the residual, and the layer becomes ``Gemma4ZooDecoderLayer``, whose forward
calls it where Gemma 4's calls those four modules.

``discover`` does that regrouping on each native MoE layer (its checks first), both when a native model is converted
and when a zoo model is built from its config, so the rest of the conversion reads a block at ``moe`` as for any
family. Export writes the four modules' tensors back under the decoder layer (``native_in_layer``)."""
from __future__ import annotations


import torch

from zoo.architectures.family import NotConvertible
from zoo.architectures.generic import RenamedBlockFamily, activation_name
from zoo.moe.layout import build_block
from zoo.moe.norms import as_block_norm

# native key (below the decoder layer) -> zoo key (below the SparseMoE)
RENAMES = {"router.proj.weight": "router.weight", "router.scale": "router.scale",
           "router.per_expert_scale": "router.per_expert_scale",
           "experts.gate_up_proj": "experts.gate_up_proj", "experts.down_proj": "experts.down_proj",
           "pre_feedforward_layernorm_2.weight": "input_norm.weight",
           "post_feedforward_layernorm_2.weight": "output_norm.weight"}


class Gemma4(RenamedBlockFamily):
    renames, label = RENAMES, "Gemma 4"
    native_in_layer = True  # export: the block's native tensors sit in the decoder layer itself
    # its native plans shard experts held by the decoder layer itself (``layers.*.experts``), beside the layer's
    # attention and dense MLP; the zoo block regroups them at ``moe``: no rewrite of those plans yet, so TP/EP
    # loading keeps every module whole (exact)
    parallel_plans = False

    def __init__(self, model_type: str = "gemma4_text", auto: str = "causal-lm"):
        part = "" if model_type == "gemma4_text" else "the language model of the vision-language model: "
        super().__init__(model_type, auto, summary=f"Gemma 4 decoder ({part}softmax top-k routing of an RMS-normed, "
                                                   "scaled residual, normed experts beside a dense MLP).")

    # ---- where the blocks are -------------------------------------------------------------------------------
    def discover(self, base) -> None:
        from zoo.architectures.gemma4_modules import (PARTS, Gemma4NativeMoe, Gemma4TextDecoderLayer,
                                                      Gemma4ZooDecoderLayer)

        self.layers_path = "language_model.layers" if hasattr(base, "language_model") else "layers"
        self.block_attr, self.block_class = "moe", Gemma4NativeMoe
        layers = [layer for layer in base.get_submodule(self.layers_path)
                  if type(layer) is Gemma4TextDecoderLayer and layer.enable_moe_block]
        if not layers:
            return
        with torch.device("cpu"):  # its norms are probed on real tensors, also while a load builds the model on meta
            self.spec(Gemma4NativeMoe(*(getattr(layers[0], p) for p in PARTS)), layers[0].config)  # refuses first
        for layer in layers:
            Gemma4ZooDecoderLayer.adopt(layer)

    def native_layer_class(self, layer_class: type) -> type:
        from zoo.architectures.gemma4_modules import Gemma4TextDecoderLayer, Gemma4ZooDecoderLayer

        return Gemma4TextDecoderLayer if issubclass(layer_class, Gemma4ZooDecoderLayer) else layer_class

    def regroup_layer(self, layer) -> None:
        from zoo.architectures.gemma4_modules import Gemma4TextDecoderLayer, Gemma4ZooDecoderLayer

        if type(layer) is Gemma4TextDecoderLayer and layer.enable_moe_block:
            Gemma4ZooDecoderLayer.adopt(layer)

    @staticmethod
    def read_block(block, config) -> dict:
        return block_entry(block, config)


def block_entry(block, config) -> dict:
    """The layout entry of one Gemma 4 layer's MoE modules (shapes only: works on the meta device)."""
    experts, router = block.experts, block.router
    if getattr(experts, "is_transposed", False) or getattr(experts, "has_bias", False):
        raise NotConvertible(f"{type(experts).__name__}: the zoo reads Gemma 4 experts as gate_up [E, 2I, H] and "
                             "down [E, H, I] without biases")
    E, two_i, H = experts.gate_up_proj.shape
    norms = {name: as_block_norm(getattr(block, native), H)
             for name, native in (("input_norm", "pre_feedforward_layernorm_2"),
                                  ("output_norm", "post_feedforward_layernorm_2"))}
    missing = [name for name, options in norms.items() if options is None]
    if missing:
        raise NotConvertible(f"Gemma 4's {', '.join(missing)} computes none of the zoo's RMS norms")
    entry = {"num_experts": E, "num_experts_per_tok": config.top_k_experts, "router": "gemma4-topk",
             "router_options": {"bias": False, "eps": float(router.eps)},
             "experts": "swiglu",
             "experts_options": {"num_experts": E, "hidden_size": H, "intermediate_size": two_i // 2, "bias": False,
                                 "activation": activation_name(experts.act_fn, config)},
             "shared_experts": None, "returns_router_scores": False, **norms}
    try:
        with torch.device("meta"):
            return build_block(entry).layout()  # as a converted block records itself
    except ValueError as exc:
        raise NotConvertible(f"Gemma 4 MoE layer: {exc}") from None
