"""JetMoE: every decoder layer holds two mixtures of experts, one of attention heads (``self_attention.experts``,
MoA: each token's query and output projections come from its top-k of the attention experts) and one of MLPs
(``mlp``). The zoo converts the MLP mixture, the one its routers, compressors and quantizer act on; the attention
mixture stays JetMoE's own module, trained, saved and exported as it is.

The MLP block routes by a softmax over the top-k of its fp32 logits (``topk-softmax`` renormalised: the same
weights), runs SwiGLU experts stored as ``input_linear`` [E, 2I, H] (gate rows first) and ``output_linear``
[E, H, I], and adds a bias to the summed output: the zoo block's ``output_bias``.

JetMoE's balance loss covers both mixtures' routers (every layer's attention and MLP gating, as one list): the zoo
records the attention gatings beside its own routers (``extra_routers``), so the loss stays the family's.
"""
from __future__ import annotations

from zoo.architectures.family import NotConvertible, NotExportable
from zoo.architectures.generic import RenamedBlockFamily, activation_name, recorded_entry

# native key (below the MLP block) -> zoo key
RENAMES = {"router.layer.weight": "router.weight", "input_linear.weight": "experts.gate_up_proj",
           "output_linear.weight": "experts.down_proj", "bias": "output_bias.bias"}


class Jetmoe(RenamedBlockFamily):
    renames, label = RENAMES, "JetMoE"

    def __init__(self):
        super().__init__("jetmoe", "causal-lm",
                         summary="JetMoE decoder (a mixture of attention heads and a mixture of SwiGLU MLP experts in "
                                 "every layer, softmax top-k routing, an output bias on the MLP mixture).",
                         paper="Shen et al., JetMoE: Reaching Llama2 Performance with 0.1M Dollars, 2024. "
                               "arXiv:2404.07413")

    def discover(self, base) -> None:
        from transformers.models.jetmoe.modeling_jetmoe import JetMoeMoE

        self.layers_path, self.block_attr, self.block_class = "layers", "mlp", JetMoeMoE

    def extra_routers(self) -> tuple:
        """Native router modules whose logits the family's balance loss also reads: (class, index of the logits in
        its output)."""
        from transformers.models.jetmoe.modeling_jetmoe import JetMoeTopKGating

        return ((JetMoeTopKGating, 4),)

    def aux_loss_coef(self, config) -> float:
        return config.aux_loss_coef

    @staticmethod
    def read_block(block, config) -> dict:
        return block_entry(block, config)

    def native_values(self, values: dict, first: dict, config) -> dict:
        # one expert count and k serve both mixtures natively: the MLP's must still equal the attention's
        if (first["num_experts"], first["num_experts_per_tok"]) != (config.num_local_experts,
                                                                     config.num_experts_per_tok):
            raise NotExportable(f"the MLP mixture has {first['num_experts']} experts, top-"
                                f"{first['num_experts_per_tok']}, the attention mixture {config.num_local_experts}, "
                                f"top-{config.num_experts_per_tok}: a native JetMoE config holds one count and k "
                                "for both")
        return values


def block_entry(block, config) -> dict:
    """The layout entry of a native JetMoE MLP mixture (shapes only: works on the meta device)."""
    E, two_i, H = block.input_linear.weight.shape
    if tuple(block.output_linear.weight.shape) != (E, H, two_i // 2) or block.router.layer.bias is not None:
        raise NotConvertible("JetMoE MLP mixture: experts or router of an unexpected shape")
    entry = {"num_experts": E, "num_experts_per_tok": block.router.top_k, "router": "topk-softmax",
             "router_options": {"bias": False, "norm_topk_prob": True},
             "experts": "swiglu",
             "experts_options": {"num_experts": E, "hidden_size": H, "intermediate_size": two_i // 2, "bias": False,
                                 "activation": activation_name(block.activation, config)},
             "shared_experts": None, "returns_router_scores": False, "output_bias": {"hidden_size": H}}
    return recorded_entry(entry, "JetMoE")
