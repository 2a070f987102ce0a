"""ERNIE-4.5-VL (``ernie4_5_vl_moe``): modality-isolated experts. Each sparse layer of the language model holds two
MoE blocks, one for text tokens and one for vision tokens (``text_moe``, ``vision_moe``: each its own router and
experts, the vision experts of another width, ``moe_intermediate_size[1]``), and one shared MLP that every token goes
through. ``moe_mm_token_type_ids`` tells each token's modality (0 text; 1 image, 2 video: vision); without it, or
without vision tokens, every token goes to the text block. Each router scores its experts by a softmax of fp32
logits, picks the top k of the scores plus a selection-only bias (``moe_statics.e_score_correction_bias``) and
renormalises the picked scores (the native clamps their sum at ``moe_norm_min``, the zoo adds 1e-20: the same
wherever they sum above 1e-12): ``scored-topk`` with ``selection_bias``, as the text-only ERNIE 4.5 MoE converts.

The zoo layer is a ``ModalityMoE`` (``zoo.moe.modality``): a SparseMoE per modality, at ``mlp.text_moe.mlp`` and
``mlp.vision_moe.mlp``, and a ``SharedMLP`` at ``mlp.shared_experts`` (the native names). ``layer_paths`` lists each
decoder layer followed, in a sparse layer, by its two parts, so the layout gives every part an entry of its own:
compressors, router swaps and the quantizer visit the parts one by one, and the parts may come to differ (a prune to
other expert counts). The native decoder layer hands the token types only to its own block class, so the family's
decoder layers take a forward that hands them to the ``ModalityMoE``.

Export writes the native layout back while every text part has the same shape, every vision part too, and both
parts have the same expert count and k (one ``moe_num_experts`` and ``moe_k`` in the native config). Streaming from
shards is not supported (the layer list differs from the native model's).
"""
from __future__ import annotations

import json
from functools import cache

import torch

from zoo.architectures.family import NotConvertible, NotExportable
from zoo.architectures.generic import RenamedBlockFamily, activation_name, first_difference, recorded_entry
from zoo.moe.layout import build_block
from zoo.moe.modality import ModalityMoE

LAYERS = "language_model.layers"
PARTS = ("text_moe", "vision_moe")  # in token-type order: type 0 text, types 1 (image) and 2 (video) vision
BIAS = "gate.moe_statics.e_score_correction_bias"  # [1, E] natively, [E] in the zoo's router
RENAMES = {"gate.weight": "router.weight", BIAS: "router.e_score_correction_bias",
           "experts.gate_up_proj": "experts.gate_up_proj", "experts.down_proj": "experts.down_proj"}
SHARED = ("gate_proj", "up_proj", "down_proj")


class Ernie45VL(RenamedBlockFamily):
    renames, label = RENAMES, "ERNIE-4.5-VL"
    native_in_layer = True  # export: a part's native tensors sit in its holder (``mlp.text_moe.gate.weight``)
    stream_refused = ("ERNIE-4.5-VL's layout lists per-modality parts inside its decoder layers, which streaming "
                      "from shards (one whole decoder layer at a time) does not take")

    def __init__(self):
        super().__init__("ernie4_5_vl_moe", "image-text-to-text",
                         summary="ERNIE-4.5-VL (modality-isolated experts: a text and a vision MoE block per sparse "
                                 "layer, chosen per token by its type, beside a shared MLP; softmax top-k routing "
                                 "with a selection bias).",
                         paper="Baidu ERNIE Team, ERNIE 4.5 Technical Report, 2025")
        self.layers_path = LAYERS

    # ---- where the blocks are -------------------------------------------------------------------------------
    def discover(self, base) -> None:
        from transformers.models.ernie4_5_vl_moe.modeling_ernie4_5_vl_moe import Ernie4_5_VLMoeMoeBlock

        self.layers_path, self.block_attr, self.block_class = LAYERS, "mlp", Ernie4_5_VLMoeMoeBlock

    def layer_paths(self, base) -> list[str] | None:
        """Each decoder layer, and after a converted sparse layer its parts; None while the layers are native."""
        layers = base.get_submodule(LAYERS)
        if not any(isinstance(layer.mlp, ModalityMoE) for layer in layers):
            return None
        paths = []
        for i, layer in enumerate(layers):
            paths.append(f"{LAYERS}.{i}")
            if isinstance(layer.mlp, ModalityMoE):
                paths += [f"{LAYERS}.{i}.mlp.{name}" for name in layer.mlp.part_names]
        return paths

    def hold_blocks(self, base) -> None:
        """Native blocks become ``ModalityMoE`` holders of the native shape (the layout rebuilds their parts next)."""
        self.discover(base)
        for layer in base.get_submodule(LAYERS):
            if isinstance(layer.mlp, self.block_class):
                layer.mlp = self.from_native(layer.mlp, base.config)

    def prepare(self, base) -> None:
        cls = decoder_layer_class()
        for layer in base.get_submodule(LAYERS):
            if isinstance(layer.mlp, ModalityMoE) and type(layer) is cls.__bases__[0]:
                layer.__class__ = cls

    # ---- one block ------------------------------------------------------------------------------------------
    def from_native(self, block, config) -> ModalityMoE:
        from zoo.moe import SharedMLP

        text = self.text_config(config)
        parts = {}
        for name in PARTS:
            native = getattr(block, name)
            with torch.device("meta"):
                parts[name] = build_block(part_entry(native, text))
            parts[name].load_state_dict(self.to_zoo_state(native.state_dict()), strict=True, assign=True)
        shared = block.shared_experts
        if shared is not None:
            if shared.gate_proj.bias is not None:
                raise NotConvertible("ERNIE-4.5-VL with use_bias: the zoo's shared MLP holds no biases")
            with torch.device("meta"):
                shared_mlp = SharedMLP(text.hidden_size, shared.intermediate_size,
                                       activation=activation_name(shared.act_fn, text))
            shared_mlp.load_state_dict({f"{p}.weight": getattr(shared, p).weight for p in SHARED}, strict=True,
                                       assign=True)
            shared = shared_mlp
        moe = ModalityMoE(parts, shared)
        key = json.dumps(text.to_dict(), sort_keys=True, default=str)
        if key not in self._specs and all(t.device.type != "meta" and t.dtype == torch.float32
                                          for t in block.parameters()):
            verify(block, moe, text.hidden_size)
            self._specs[key] = {"verified": True}
        return moe

    def to_zoo_state(self, sd: dict) -> dict:
        out = super().to_zoo_state(sd)
        if "router.e_score_correction_bias" in out:
            out["router.e_score_correction_bias"] = out["router.e_score_correction_bias"].reshape(-1)
        return out

    def to_native_state(self, sd: dict) -> dict:
        out = super().to_native_state(sd)
        if BIAS in out:
            out[BIAS] = out[BIAS].reshape(1, -1)
        return out

    # ---- export -----------------------------------------------------------------------------------------------
    def native_config(self, config, layout):
        moe = {i: e for i, e in enumerate(layout) if e}
        if not moe:
            raise NotExportable("the model has no MoE layer")
        self._check_exportable_parts(config)
        first = next(iter(moe.values()))
        values = {k: v for k, v in config.to_dict().items() if not k.startswith("zoo_") and k != "model_type"}
        values["text_config"].update(moe_num_experts=first["num_experts"], moe_k=first["num_experts_per_tok"])
        try:
            native = self.config_class(**values)
            with torch.device("meta"):
                model = self.model_class(native)
            expected = native_layout(model.model, self.block_class, self.text_config(native))
        except Exception as exc:  # the config class's own validators, or a block it cannot build
            raise NotExportable(f"a native {self.label} config cannot hold {first['num_experts']} experts, "
                                f"top-{first['num_experts_per_tok']}: {exc}") from None
        if [i for i, e in enumerate(expected) if e] != list(moe):
            raise NotExportable(f"MoE parts {sorted(moe)} differ from the native pattern "
                                f"{[i for i, e in enumerate(expected) if e]}")
        for i, e in moe.items():
            if e != expected[i]:
                raise NotExportable(f"layout entry {i}: {first_difference(e, expected[i])} (a native config holds "
                                    "one expert count and k for both modalities, and one shape per modality)")
        return native


def part_entry(part, config) -> dict:
    """The layout entry of one native modality block (``Ernie4_5_VLMoeSparseMoeBlock``; shapes only: works on meta)."""
    gate, experts = part.gate, part.experts
    E = experts.num_experts
    entry = {"num_experts": E, "num_experts_per_tok": gate.top_k, "router": "scored-topk",
             "router_options": {"score": "softmax", "norm_topk_prob": True, "routed_scaling_factor": 1.0,
                                "selection_bias": True, "n_group": 1, "topk_group": 1, "group_score": "top2",
                                "logit_softcap": 0.0, "bias_on": "scores", "bias": False},
             "experts": "swiglu",
             "experts_options": {"num_experts": E, "hidden_size": experts.hidden_dim,
                                 "intermediate_size": experts.intermediate_dim, "bias": False,
                                 "activation": activation_name(experts.act_fn, config)},
             "shared_experts": None, "returns_router_scores": False}
    return recorded_entry(entry, "ERNIE-4.5-VL")


def native_layout(base, block_class, config) -> list[dict | None]:
    """The layout a native model's structure gives (``Ernie45VL.layer_paths`` order), read off its blocks."""
    out = []
    for layer in base.get_submodule(LAYERS):
        out.append(None)
        if isinstance(layer.mlp, block_class):
            out += [part_entry(getattr(layer.mlp, name), config) for name in PARTS]
    return out


def verify(native, moe: ModalityMoE, width: int) -> None:
    """The converted layer computes what the native one does, on random tokens of every type, and without types."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, width, generator=gen).to(next(native.parameters()).device)
    types = torch.randint(0, 3, (2, 8), generator=gen).to(x.device)
    with torch.no_grad():
        for t in (types, None):
            want, got = native(x, t)[0], moe(x, t)
            err = ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
            if not err <= 1e-4:
                raise NotConvertible(f"the converted ERNIE-4.5-VL layer differs from the native one (relative "
                                     f"error {err:.2e})")


@cache
def decoder_layer_class():
    """The family's decoder layer with a forward that hands the token types to a ``ModalityMoE`` (the native one
    hands them only to its own block class). Made on first use: importing the family's modeling costs time."""
    from transformers.models.ernie4_5_vl_moe.modeling_ernie4_5_vl_moe import Ernie4_5_VLMoeDecoderLayer
    from transformers.utils.deprecation import deprecate_kwarg

    class ZooErnie4_5_VLMoeDecoderLayer(Ernie4_5_VLMoeDecoderLayer):
        @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
        def forward(self, hidden_states, position_embeddings, attention_mask=None, position_ids=None,
                    moe_mm_token_type_ids=None, cache=None, **kwargs):
            residual = hidden_states
            hidden_states, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states),
                                              position_embeddings=position_embeddings, attention_mask=attention_mask,
                                              position_ids=position_ids, cache=cache, **kwargs)
            hidden_states = hidden_states + residual
            residual = hidden_states
            hidden_states = self.post_attention_layernorm(hidden_states)
            if isinstance(self.mlp, ModalityMoE):
                return self.mlp(hidden_states, moe_mm_token_type_ids) + residual
            return self.mlp(hidden_states) + residual

    return ZooErnie4_5_VLMoeDecoderLayer
