"""Inkling (v1): a decoder whose MoE blocks weigh their shared experts per token, by the same router that picks the
routed experts.

The router's gate has a row per routed expert and then one per shared expert (E + S rows). The k routed experts are
picked by sigmoid scores plus a selection-only bias; the k picked logits and the S shared logits are then normalised
together (sigmoid scores divided by their sum over those k + S) and scaled by ``route_scale`` times a learned
``global_scale``. The first k weights weigh the routed experts as usual; the last S weigh each shared expert for that
token, so the shared experts stand beside the routed ones in one normalisation instead of being always on at a fixed
weight. The zoo holds that rule as the ``inkling-topk`` router, whose ``Routing.shared_weights`` [T, S] the block
hands to its shared experts.

The S shared experts (gated MLPs of the experts' width, stored natively as ``[S, I, H]`` / ``[S, H, I]`` stacks)
become one ``SharedMLP`` of width S * I with ``num_experts=S``: expert s is its s-th slice of intermediate channels,
whose activations are multiplied by that expert's weight before the down projection, as Inkling multiplies them.
Conversion reshapes the stacks into that MLP and export reshapes them back. Pruning and merging routed experts keep
the gate's shared rows (``zoo.moe.surgery``); a router of another rule leaves the shared experts unweighted.

The vision-language model (``inkling_mm_model``: vision and audio towers beside the language model) converts the
language model's MoE blocks the same way. Export writes the native format back as long as every MoE layer keeps one
expert count, k, expert width and the ``inkling-topk`` router.
"""
from __future__ import annotations

from zoo.architectures.family import NotConvertible
from zoo.architectures.generic import RenamedBlockFamily, activation_name, recorded_entry

SHARED = ("gate_proj", "up_proj", "down_proj")
# native key (below the block) -> zoo key
RENAMES = {"gate.weight": "router.weight", "gate.global_scale": "router.global_scale",
           "gate.e_score_correction_bias": "router.e_score_correction_bias",
           "experts.gate_up_proj": "experts.gate_up_proj", "experts.down_proj": "experts.down_proj",
           **{f"shared_experts.{p}": f"shared_experts.{p}.weight" for p in SHARED}}


class Inkling(RenamedBlockFamily):
    renames, label = RENAMES, "Inkling"
    # Inkling's own fp32 modules, its router's global scale under the zoo's name
    keep_in_fp32 = ["attn_sconv", "mlp_sconv", "k_sconv", "v_sconv", "e_score_correction_bias", "router.global_scale"]
    # the native TP plan splits each shared expert's projections; the zoo's one MLP of S slices would need its weights
    # split per slice: no rewrite of those plans yet, so TP/EP loading keeps every module whole (exact)
    parallel_plans = False

    def __init__(self, model_type: str = "inkling_text", auto: str = "causal-lm"):
        part = "" if model_type == "inkling_text" else "the language model of the vision-language model: "
        super().__init__(model_type, auto,
                         summary=f"Inkling decoder ({part}one sigmoid router scores routed and shared experts "
                                 "together: top-k with a selection bias, the picked and the shared experts weighted "
                                 "per token by one normalisation).",
                         paper="Thinking Machines Lab, Inkling, 2026 (model card: thinkingmachines/Inkling)")

    # ---- where the blocks are -------------------------------------------------------------------------------
    def discover(self, base) -> None:
        from transformers.models.inkling.modeling_inkling import InklingMoE

        self.layers_path = "language_model.layers" if hasattr(base, "language_model") else "layers"
        self.block_attr, self.block_class = "mlp", InklingMoE

    # ---- one block ------------------------------------------------------------------------------------------
    @staticmethod
    def read_block(block, config) -> dict:
        return block_entry(block, config)

    def to_zoo_state(self, sd: dict) -> dict:
        out = super().to_zoo_state(sd)
        for p in ("gate_proj", "up_proj"):  # [S, I, H] -> [S * I, H]: expert s's rows are the s-th slice
            out[f"shared_experts.{p}.weight"] = out[f"shared_experts.{p}.weight"].flatten(0, 1)
        down = out["shared_experts.down_proj.weight"]  # [S, H, I] -> [H, S * I]
        out["shared_experts.down_proj.weight"] = down.transpose(0, 1).flatten(1)
        return out

    def to_native_state(self, sd: dict) -> dict:
        out = super().to_native_state(sd)
        S = sd["router.weight"].shape[0] - sd["router.e_score_correction_bias"].shape[0]  # the gate's shared rows
        for p in ("gate_proj", "up_proj"):
            out[f"shared_experts.{p}"] = out[f"shared_experts.{p}"].unflatten(0, (S, -1))
        out["shared_experts.down_proj"] = out["shared_experts.down_proj"].unflatten(1, (S, -1)).transpose(0, 1) \
            .contiguous()
        return out

    # ---- export -----------------------------------------------------------------------------------------------
    def native_values(self, values: dict, first: dict, config) -> dict:
        text = values.get("text_config", values)  # the vision-language config's text part
        text.update(n_routed_experts=first["num_experts"], num_experts_per_tok=first["num_experts_per_tok"],
                    moe_intermediate_size=first["experts_options"].get("intermediate_size"))
        if first["router"] == "inkling-topk":  # (a rule of another router is refused by the comparison)
            text["route_scale"] = first["router_options"]["route_scale"]
        return values


def block_entry(block, config) -> dict:
    """The layout entry of a native Inkling MoE block (shapes only: works on the meta device)."""
    gate, experts, shared = block.gate, block.experts, block.shared_experts
    S, H = gate.n_shared_experts, experts.hidden_dim
    if not S:
        raise NotConvertible("Inkling with n_shared_experts=0: its router takes the shared experts' logits off the "
                             "end of the gate's and cannot run without them")
    act = activation_name(shared.act_fn, config)
    entry = {"num_experts": experts.num_experts, "num_experts_per_tok": gate.top_k, "router": "inkling-topk",
             "router_options": {"bias": False, "shared_experts": S, "route_scale": float(gate.route_scale)},
             "experts": "swiglu",
             "experts_options": {"num_experts": experts.num_experts, "hidden_size": H,
                                 "intermediate_size": experts.intermediate_dim, "bias": False,
                                 "activation": activation_name(experts.act_fn, config)},
             "shared_experts": {"hidden_size": H, "intermediate_size": S * shared.gate_proj.shape[1], "gated": False,
                                "num_experts": S, **({"activation": act} if act != "silu" else {})},
             "returns_router_scores": False}
    return recorded_entry(entry, "Inkling")
