"""DeepSeek-V4: what the generic adapter cannot read off its blocks.

Its MoE layers are of two kinds (``config.mlp_layer_types``): ``hash_moe`` blocks route by token id through a fixed
table (``gate.tid2eid``, Hash Layers), which the zoo's ``token-hash`` router holds; ``moe`` blocks route by top-k of
``sqrtsoftplus`` scores with a selection-only bias, which ``scored-topk`` states. Both renormalise (always) and
scale by ``routed_scaling_factor``; experts and the shared MLP are SwiGLU clamped at ``swiglu_limit``. Each kind
has its own layout entry and key names, so the spec is read per block kind.

The native model hands each block the call's ``input_ids``; a zoo router reads them from the routing context,
which the base model publishes here for each call that has none yet (a model just converted in memory: zoo
model classes and ``zoo.apply`` attach the context at the top as well).

Export writes the native format back, hash tables included, as long as every layer keeps the native structure
(its expert count, k and routing); a hash layer whose experts were pruned or merged has no native form.
"""
from __future__ import annotations

import json

import torch

from zoo.architectures.family import Family, NotConvertible, NotExportable
from zoo.architectures.generic import GenericFamily, first_difference
from zoo.moe.layout import build_block
from zoo.moe import RoutingContext, routing_context

# native key -> zoo key, in every block and in each kind's
COMMON = {"gate.weight": "router.weight", "experts.gate_up_proj": "experts.gate_up_proj",
          "experts.down_proj": "experts.down_proj",
          **{f"shared_experts.{p}.weight": f"shared_experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}}
RENAMES = {"hash": {**COMMON, "gate.tid2eid": "router.tid2eid"},
           "topk": {**COMMON, "gate.e_score_correction_bias": "router.e_score_correction_bias"}}
EXPERT_MAP = "router.expert_map"  # token-hash's own: the identity for a native block
VERIFY_TOKENS = 16


class DeepseekV4(GenericFamily):
    def __init__(self):
        super().__init__("deepseek_v4", "causal-lm",
                         summary="DeepSeek-V4 decoder (hash-routed first MoE layers, sqrt-softplus top-k routing with "
                                 "a selection bias, clamped SwiGLU experts, a shared expert, hyper-connections).",
                         paper="DeepSeek-AI, DeepSeek-V4, 2026")

    # ---- one block ------------------------------------------------------------------------------------------
    def spec(self, block, config) -> dict:
        """The layout entry of a native block; hash and top-k blocks of one config differ, so both are kept."""
        kind = "hash" if block.is_hash else "topk"
        text = self.text_config(config)
        key = f"{kind}:{json.dumps(text.to_dict(), sort_keys=True, default=str)}"
        if key not in self._specs:
            self._specs[key] = {"entry": block_entry(block, text, kind), "kind": kind}
        return self._specs[key]

    def from_native(self, block, config):
        spec = self.spec(block, config)
        with torch.device("meta"):
            moe = build_block(spec["entry"])
        moe.load_state_dict(self.to_zoo_state(block.state_dict()), strict=True, assign=True)
        if not spec.get("verified") and all(t.device.type != "meta" and t.dtype == torch.float32
                                            for t in block.parameters()):
            verify(block, moe)
            spec["verified"] = True
        return moe

    def to_zoo_state(self, sd: dict) -> dict:
        kind = "hash" if "gate.tid2eid" in sd else "topk"
        out = {}
        for key, value in sd.items():
            if key not in RENAMES[kind]:
                raise NotConvertible(f"DeepSeek-V4 block tensor {key} has no zoo counterpart")
            out[RENAMES[kind][key]] = value
        if kind == "hash":
            experts = sd["experts.gate_up_proj"].shape[0]
            out[EXPERT_MAP] = torch.eye(experts, device=sd["gate.weight"].device)
        return out

    def to_native_state(self, sd: dict) -> dict:
        kind = "hash" if "router.tid2eid" in sd else "topk"
        back = {zoo: native for native, zoo in RENAMES[kind].items()}
        sd = dict(sd)
        if kind == "hash":
            expert_map = sd.pop(EXPERT_MAP, None)
            if expert_map is None or not torch.equal(expert_map.float(), torch.eye(*expert_map.shape,
                                                                                   device=expert_map.device)):
                raise NotExportable("a hash layer's experts were pruned or merged (its expert map is not the "
                                    "identity): a native DeepSeek-V4 hash layer has one expert per table id")
        missing = sorted(set(sd) - set(back))
        if missing:
            raise NotExportable(f"{missing[0]} has no place in the native DeepSeek-V4 block")
        return {back[k]: v for k, v in sd.items()}

    # ---- export -----------------------------------------------------------------------------------------------
    def native_config(self, config, layout):
        moe = {i: e for i, e in enumerate(layout) if e}
        if not moe:
            raise NotExportable("the model has no MoE layer")
        Family._check_exportable_parts(self, config)
        for i, e in moe.items():
            table = e["router_options"].get("table_experts")
            if e["router"] == "token-hash" and table != e["num_experts"]:
                raise NotExportable(f"layer {i}: its hash table names {table} experts but the layer has "
                                    f"{e['num_experts']} (pruned or merged): a native DeepSeek-V4 hash layer has one "
                                    "expert per table id")
        sizes = {(e["num_experts"], e["num_experts_per_tok"]) for e in moe.values()}
        if len(sizes) > 1:
            raise NotExportable(f"MoE layers differ in expert count or k ({sorted(sizes)}): a native DeepSeek-V4 "
                                "config holds one of each for all layers")
        (experts, k), = sizes
        values = {key: v for key, v in config.to_dict().items() if not key.startswith("zoo_") and key != "model_type"}
        values.update(n_routed_experts=experts, num_experts_per_tok=k)
        try:
            native = self.config_class(**values)
            ids, blocks = self._meta_blocks(native)
        except Exception as exc:  # the config class's own validators
            raise NotExportable(f"a native DeepSeek-V4 config cannot hold {experts} experts, top-{k}: {exc}") from None
        if set(ids) != set(moe):
            raise NotExportable(f"MoE layers {sorted(moe)} differ from the native pattern {sorted(ids)}")
        for i, block in zip(ids, blocks):
            want = self.spec(block, native)["entry"]
            if moe[i] != want:
                raise NotExportable(f"layer {i}: {first_difference(moe[i], want)}")
        return native


def block_entry(block, config, kind: str) -> dict:
    """The layout entry of a native DeepSeek-V4 block (shapes only: works on the meta device)."""
    experts, shared = block.experts, block.shared_experts
    if experts.is_transposed or experts.has_bias or not experts.is_concatenated:
        raise NotConvertible(f"{type(experts).__name__}: the zoo reads DeepSeek-V4 experts as gate_up [E, 2I, H] and "
                             "down [E, H, I] without biases")
    if config.hidden_act != "silu" or getattr(config, "mlp_bias", False):
        raise NotConvertible(f"DeepSeek-V4 with hidden_act={config.hidden_act!r}, mlp_bias="
                             f"{getattr(config, 'mlp_bias', False)}: the zoo's clamped SwiGLU is silu without biases")
    scoring = config.scoring_func
    E, two_i, H = experts.gate_up_proj.shape
    k, limit, scale = config.num_experts_per_tok, float(config.swiglu_limit), float(config.routed_scaling_factor)
    if kind == "hash":  # norm_topk_prob is not read: DeepSeek-V4's routers always renormalise
        router = "token-hash"
        options = {"vocab_size": block.gate.tid2eid.shape[0], "score": scoring, "norm_topk_prob": True,
                   "routed_scaling_factor": scale, "table_experts": E, "bias": False}
    else:
        router = "scored-topk"
        options = {"score": scoring, "norm_topk_prob": True, "routed_scaling_factor": scale, "selection_bias": True,
                   "n_group": 1, "topk_group": 1, "group_score": "top2", "logit_softcap": 0.0, "bias_on": "scores",
                   "bias": False}
    entry = {"num_experts": E, "num_experts_per_tok": k, "router": router, "router_options": options,
             "experts": "swiglu",
             "experts_options": {"num_experts": E, "hidden_size": H, "intermediate_size": two_i // 2, "bias": False,
                                 "activation": "clamped-silu", "swiglu_limit": limit},
             "shared_experts": {"hidden_size": H, "intermediate_size": shared.gate_proj.out_features, "gated": False,
                                "activation": "clamped-silu", "swiglu_limit": limit},
             "returns_router_scores": False}
    try:
        with torch.device("meta"):
            return build_block(entry).layout()  # as a converted block records itself
    except ValueError as exc:  # e.g. a scoring function no zoo router computes
        raise NotConvertible(f"DeepSeek-V4 {kind} block (scoring_func={scoring!r}): {exc}") from None


def verify(native, moe) -> None:
    """The converted block computes what the native one does, on random tokens (and token ids for a hash block),
    at the usual scale and at a large one where the SwiGLU clamps act."""
    device = next(native.parameters()).device
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, VERIFY_TOKENS, moe.experts.hidden_size, generator=gen).to(device)
    ids = torch.randint(0, native.gate.tid2eid.shape[0], (1, VERIFY_TOKENS), generator=gen).to(device) \
        if native.is_hash else None
    for factor in (1.0, 100.0):
        with torch.no_grad(), routing_context(RoutingContext(input_ids=ids)):
            want, got = native(x * factor, input_ids=ids), moe(x * factor)
        err = ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
        if not err <= 1e-4:
            raise NotConvertible(f"the converted block differs from {type(native).__name__} (relative error "
                                 f"{err:.2e} on inputs scaled by {factor:g})")
