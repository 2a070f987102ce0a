"""Doge (SmallDoge): with ``is_moe`` each decoder layer's MLP is a "cross-domain" MoE (``DogeCDMoE``): a dense gated
MLP every token runs, plus E tiny retrieval experts chosen per token by product keys. Expert e is one row of each of
two embeddings, ``down_embed[e]`` and ``up_embed[e]`` ([E, H] each): it adds ``act(down_embed[e] . x) * w *
up_embed[e]``, an MLP one neuron wide. The router (``router_gate``, [2n, H] with n = sqrt(E)) scores two sets of n
sub-keys; expert ``i * n + j`` scores the sum of sub-key i of the first set and j of the second, the k best sums are
picked and weighed by a softmax over them (renormalised again with ``norm_topk_prob``, a no-op up to rounding).

transformers reads the two sets off the flat [T, 2n] logits of the call's tokens as [2, T, n], so in a forward over
many tokens a token's sets come from other tokens' logits (kept so that existing checkpoints compute what they
computed; decoding one sequence a token at a time reads its own). The zoo block holds it as it is: the router is
``product-key`` with ``split="tokens"`` (``"halves"`` is the papers' per-token rule, a router swap away), the experts
are the zoo's ungated ``mlp`` experts one neuron wide (``up_proj`` [E, 1, H] is ``down_embed``, ``down_proj`` [E, H,
1] is ``up_embed`` transposed), and the dense MLP is the block's shared MLP (no sigmoid gate). The decoder layer
takes the block's output as the first item of a tuple, so the block returns ``(output, weights)``. The learned
residual scales of the decoder layer and the dynamic-mask attention stay native.

Export writes Doge's own layout back while every layer holds a square number of experts with the router as
converted. A pruned model keeps its router's sub-keys and names the product id of each remaining expert
(``expert_ids``): a native Doge block routes among all n * n pairs, so that model is refused by export. Its balance
loss is Doge's own, on the zoo routers' logits (the experts' summed scores): ``zoo.moe.losses.slot_balance_loss``.
"""
from __future__ import annotations

from zoo.architectures.family import NotConvertible, NotExportable
from zoo.architectures.generic import RenamedBlockFamily, activation_name, recorded_entry

# native key (below the block) -> zoo key; the embeddings are reshaped (to_zoo_state)
RENAMES = {"router_gate.weight": "router.weight", "gate_proj.weight": "shared_experts.gate_proj.weight",
           "up_proj.weight": "shared_experts.up_proj.weight", "down_proj.weight": "shared_experts.down_proj.weight",
           "down_embed.weight": "experts.up_proj", "up_embed.weight": "experts.down_proj"}


class Doge(RenamedBlockFamily):
    renames, label = RENAMES, "Doge"

    def __init__(self):
        super().__init__("doge", "causal-lm",
                         summary="Doge decoder (dynamic-mask attention, learned residual scales; a dense MLP plus "
                                 "one-neuron retrieval experts chosen by product keys).",
                         paper="Shi et al., Wonderful Matrices: More Efficient and Effective Architecture for "
                               "Language Modeling Tasks, 2024. arXiv:2412.11834")

    def discover(self, base) -> None:
        from transformers.models.doge.modeling_doge import DogeCDMoE

        self.layers_path, self.block_attr, self.block_class = "layers", "mlp", DogeCDMoE

    @staticmethod
    def read_block(block, config) -> dict:
        return block_entry(block, config)

    def balance_loss(self):
        from zoo.moe.losses import slot_balance_loss

        return slot_balance_loss

    def to_zoo_state(self, sd: dict) -> dict:
        out = super().to_zoo_state(sd)
        out["experts.up_proj"] = out["experts.up_proj"].unsqueeze(1)  # [E, H] -> [E, 1, H]
        out["experts.down_proj"] = out["experts.down_proj"].unsqueeze(2)  # [E, H] -> [E, H, 1]
        return out

    def to_native_state(self, sd: dict) -> dict:
        out = super().to_native_state(sd)
        out["down_embed.weight"] = out["down_embed.weight"].squeeze(1).contiguous()
        out["up_embed.weight"] = out["up_embed.weight"].squeeze(2).contiguous()
        return out

    def native_config(self, config, layout):
        pruned = next((e for e in layout if e and "expert_ids" in e["router_options"]), None)
        if pruned is not None:
            raise NotExportable(f"the experts were pruned to {pruned['num_experts']} of the "
                                f"{pruned['router_options']['num_keys'] ** 2} product-key pairs; a native Doge block "
                                "routes among all of them")
        return super().native_config(config, layout)

    def native_values(self, values: dict, first: dict, config) -> dict:
        values.update(num_experts=first["num_experts"], num_experts_per_tok=first["num_experts_per_tok"],
                      norm_topk_prob=first["router_options"].get("norm_topk_prob", False))
        if first["shared_experts"]:
            values["intermediate_size"] = first["shared_experts"]["intermediate_size"]
        return values


def block_entry(block, config) -> dict:
    """The layout entry of a native Doge MoE block (shapes only: works on the meta device)."""
    E, H, n = block.num_experts, block.hidden_size, block.num_keys
    if n * n != E:  # transformers takes n = floor(sqrt(E)): experts from n * n up could never be picked
        raise NotConvertible(f"Doge with num_experts={E}: not a square, so experts {n * n}.. are never routed to")
    if block.gate_proj.bias is not None:
        raise NotConvertible("Doge with mlp_bias: the zoo's shared MLP holds no biases")
    act = activation_name(block.act_fn, config, ungated=True)
    shared = {"hidden_size": H, "intermediate_size": block.intermediate_size, "gated": False,
              **({"activation": activation_name(block.act_fn, config)} if act != "silu" else {})}
    entry = {"num_experts": E, "num_experts_per_tok": block.top_k, "router": "product-key",
             "router_options": {"num_keys": n, "split": "tokens", "norm_topk_prob": bool(block.norm_topk_prob),
                                "bias": False},
             "experts": "mlp",
             "experts_options": {"num_experts": E, "hidden_size": H, "intermediate_size": 1, "activation": act},
             "shared_experts": shared, "returns_router_scores": True}
    return recorded_entry(entry, "Doge")

