"""A model family spec: where the MoE blocks are, how their weights map, which router they use."""
from __future__ import annotations

import torch

from zoo.architectures.lookup import NotConvertible, NotExportable, family_of  # noqa: F401  (their names here too)
from zoo.moe.layout import build_block


class Family:
    name: str = ""  # e.g. "mixtral"; the zoo model type is "zoo_<name>"
    summary: str = ""
    paper: str = ""
    card: str = "cards/architecture.md"
    space: str = "model-zoo"

    config_class = None  # the family's native config class
    model_class = None  # the family's native *ForCausalLM
    block_class = None  # the family's native MoE block class
    num_experts_key = "num_experts"
    intermediate_key = "moe_intermediate_size"
    router = "topk-softmax"
    router_config_keys: tuple[str, ...] = ("norm_topk_prob",)  # router options that are config keys too
    renames: dict[str, str] = {"gate.": "router."}  # native -> zoo key prefixes inside the MLP
    aux_loss = True
    keep_in_fp32: list[str] | None = None
    auto = "causal-lm"  # the Auto class users load the family with ("causal-lm", "image-text-to-text", "seq2seq-lm")
    zoo_forward = True  # the zoo's causal-LM forward (balance loss over layers that may differ) replaces the family's
    base_attr = "model"  # the causal LM's attribute holding the base model (DBRX: "transformer")
    has_base_model_class = True  # False: no base-model class beside the top one (Qwen3-Omni: it holds two models)
    layers_path = "layers"  # the decoder layers, below the base model
    block_attr = "mlp"  # a decoder layer's attribute holding the MoE block
    native_in_layer = False  # the native checkpoint keeps the block's tensors in the decoder layer itself (Gemma 4)
    # the native tie map is patterns over layer tensors (Diffusion Gemma's encoder layers tied to its decoder's),
    # which transformers expands over the native modules: expanded again once the zoo blocks are in place
    retie = False

    def matches(self, model) -> bool:
        """Whether ``model`` is a native model of this family."""
        return isinstance(model, self.model_class)

    def text_config(self, config):
        """The config that holds the decoder's MoE keys (a vision-language config's text part)."""
        return config

    def discover(self, base) -> None:
        """Read where the blocks are off a base model (first-party specs know it already)."""

    def layer_paths(self, base) -> list[str] | None:
        """Where each layer holding an MoE block sits below ``base``, in layout order, for a family whose MoE layers
        are not the one list at ``layers_path`` (an encoder-decoder's two stacks); None: that list."""
        return None

    def prepare(self, base) -> None:
        """Make the family's own modules ready for zoo blocks, once per model, as it becomes a zoo model."""

    def model_attributes(self) -> dict:
        """Attributes of the zoo model class beside the factory's (a forward of the family's own: Qwen3-Omni's)."""
        return {}

    def native_logits(self, model, inputs: dict):
        """The logits a native model of the family computes on ``inputs`` (the reference a conversion is checked
        against), or None where its own forward gives them (a family whose native forward does not run gives them
        another way: Llama 4 multimodal, Qwen3-Omni)."""
        return None

    def native_layer_class(self, layer_class: type) -> type:
        """The class a decoder layer of ``layer_class`` has in a native checkpoint, for reading its tensors by their
        native names (a family that regroups its layers, Gemma 4: the layer before ``regroup_layer``)."""
        return layer_class

    def regroup_layer(self, layer) -> None:
        """Turn a decoder layer read natively (``native_layer_class``) into the form this family's models hold."""

    def hold_blocks(self, base) -> None:
        """Put in place, before a saved layout is applied, the modules its blocks sit in where they are not the
        decoder layers (ERNIE-4.5-VL's per-modality parts: ``zoo.moe.modality``); nothing by default."""

    def native_copies(self, prefix: str) -> list[str]:
        """Where else than ``prefix`` a native checkpoint holds a block's tensors (tied copies: Diffusion Gemma's
        encoder layer beside the decoder layer that holds the block)."""
        return []

    # ---- structure -------------------------------------------------------------------------------
    def moe_layer_ids(self, config) -> list[int]:
        return list(range(config.num_hidden_layers))

    def router_options(self, config) -> dict:
        return {k: getattr(config, k) for k in self.router_config_keys}

    def experts_options(self, config) -> dict:
        return {"activation": "silu", "bias": False}

    def shared_options(self, config) -> dict | None:
        return None

    def aux_loss_coef(self, config) -> float:
        """The weight of the balance loss in the training loss (the config key the family reads)."""
        return config.router_aux_loss_coef

    def balance_loss(self):
        """The family's balance loss as ``f(router_logits, num_experts, top_k, attention_mask)`` over the zoo routers'
        [T, E] logits (see ``zoo.moe.losses.family_aux_loss``): the one its modeling module defines, None where its
        forward computes none. A family whose own function reads other logits (Doge's [2, T, n]) gives its own."""
        from zoo.moe.losses import native_balance_loss

        return native_balance_loss(self.model_class)

    def block_layout(self, config) -> dict:
        """The layout entry of one native MoE layer of ``config``."""
        E = getattr(config, self.num_experts_key)
        return {
            "num_experts": E,
            "num_experts_per_tok": config.num_experts_per_tok,
            "router": self.router,
            "router_options": {"bias": False, **self.router_options(config)},
            "experts": "swiglu",
            "experts_options": {"num_experts": E, "hidden_size": config.hidden_size,
                                "intermediate_size": getattr(config, self.intermediate_key),
                                **self.experts_options(config)},
            "shared_experts": self.shared_options(config),
            "returns_router_scores": False,
        }

    # ---- weights ---------------------------------------------------------------------------------
    def to_zoo_state(self, sd: dict) -> dict:
        return {_rename(k, self.renames): v for k, v in sd.items()}

    def to_native_state(self, sd: dict) -> dict:
        back = {v: k for k, v in self.renames.items()}
        return {_rename(k, back): v for k, v in sd.items()}

    def from_native(self, block, config):
        """A SparseMoE holding the native block's weights (the same tensors where no reshaping is needed)."""
        with torch.device("meta"):
            moe = build_block(self.block_layout(config))
        moe.load_state_dict(self.to_zoo_state(block.state_dict()), strict=True, assign=True)
        return moe

    # ---- export ----------------------------------------------------------------------------------
    # The native state key of a router bias that is added to the logits before top-k (GPT-OSS's ``router.bias``):
    # where a family has one, layers with fewer experts export padded to the largest count with experts whose bias
    # is the dtype's lowest value, which top-k never picks (exact). Without it a padded expert's logit would be 0,
    # which top-k can pick: such layouts are refused.
    padding_bias_key: str | None = None

    def native_config(self, config, layout: list[dict | None]):
        """The native config that expresses ``layout``, or NotExportable with the reason. Layers with fewer experts
        than the largest count are padded (``padded_experts``) where the family's router can express it exactly."""
        moe = {i: e for i, e in enumerate(layout) if e}
        if not moe:
            raise NotExportable("the model has no MoE layer")
        self._check_exportable_parts(config)
        first_i, first = next(iter(moe.items()))
        for i, e in moe.items():
            if e["num_experts_per_tok"] != first["num_experts_per_tok"]:
                raise NotExportable(
                    f"layer {i} routes each token to {e['num_experts_per_tok']} experts but layer {first_i} to "
                    f"{first['num_experts_per_tok']}: a native {self.name} config holds one k for all layers")
            if e["num_experts"] != first["num_experts"] and self.padding_bias_key is None:
                raise NotExportable(
                    f"layer {i} has {e['num_experts']} experts but layer {first_i} has {first['num_experts']}: a "
                    f"native {self.name} config holds one expert count, and its router has no bias with which a "
                    "padded expert could never be chosen (its logit would be 0), so padding would not be exact")
        count = max(e["num_experts"] for e in moe.values())
        values = {k: v for k, v in config.to_dict().items() if k in self.config_class.__dataclass_fields__}
        native = self.config_class(**self.native_moe_values(values, count, first))
        want = set(self.moe_layer_ids(native))
        if want != set(moe):
            raise NotExportable(f"MoE layers {sorted(moe)} differ from the native pattern {sorted(want)}")
        expected = self.block_layout(native)
        for i, e in moe.items():
            if e["num_experts"] != count:  # a padded layer: its own count, the rest as the native block
                e = {**e, "num_experts": count, "experts_options": {**e["experts_options"], "num_experts": count}}
            for key in expected:
                if e.get(key) != expected[key]:
                    raise NotExportable(f"layer {i}: {key} is {e.get(key)!r}, the native {self.name} block "
                                        f"needs {expected[key]!r}")
        return native

    def native_moe_values(self, values: dict, count: int, first: dict) -> dict:
        """The native config's values with its MoE keys set: ``count`` experts, the rest from the layout entry
        ``first`` (the first MoE layer's)."""
        values.update({self.num_experts_key: count, "num_experts_per_tok": first["num_experts_per_tok"],
                       self.intermediate_key: first["experts_options"].get("intermediate_size")})
        values.update({k: first["router_options"][k] for k in self.router_config_keys if k in first["router_options"]})
        return values

    def pad_native_state(self, state: dict, num_experts: int) -> dict:
        """One MoE block's native state with its experts padded to ``num_experts``: every per-expert tensor gets zero
        rows, and the router bias the dtype's lowest value (never picked by top-k, so the function is unchanged)."""
        have = state[self.padding_bias_key].shape[0]
        out = {}
        for key, t in state.items():
            if t.dim() == 0 or t.shape[0] != have:
                out[key] = t
                continue
            fill = torch.finfo(t.dtype).min if key == self.padding_bias_key else 0
            out[key] = torch.cat([t, t.new_full((num_experts - have, *t.shape[1:]), fill)])
        return out

    def export_problem(self, config, layout) -> str | None:
        """Why ``zoo.export`` would refuse this config and layout, or None when the native format can hold it."""
        try:
            self.native_config(config, layout)
        except NotExportable as exc:
            return str(exc)
        return None

    @property
    def has_shared_experts(self) -> bool:
        return type(self).shared_options is not Family.shared_options

    def _check_exportable_parts(self, config) -> None:
        """Wrapped attention and adapter modules have no native form."""
        attention = [i for i, e in enumerate(getattr(config, "zoo_attention", None) or []) if e]
        if attention:
            raise NotExportable(f"layers {attention} have {self.name} attention wrapped by "
                                f"{config.zoo_attention[attention[0]]['router']!r}, which has no native form")
        modules = getattr(config, "zoo_modules", None) or {}
        adapters = sorted({spec["adapter"] for spec in modules.values() if "adapter" in spec})
        if adapters:
            raise NotExportable(f"{len(modules)} modules carry {adapters} adapter(s); merge them into the base "
                                f"weights first (native {self.name} has no place for them)")
        if modules:
            kinds = sorted({spec.get("compressor", "?") for spec in modules.values()})
            raise NotExportable(f"{len(modules)} linear layers are compressed by {kinds} (native {self.name} stores "
                                "float weights); export to GGUF, which keeps quantized weights")

    def classes(self) -> tuple:
        """(config class, base-model class, top model class) of ``zoo_<family>``, made on first need."""
        from zoo.architectures.factory import zoo_classes

        return zoo_classes(self)

    def register_auto_classes(self) -> None:
        from zoo.architectures import peft_names
        from zoo.architectures.factory import zoo_classes, zoo_config_class

        zoo_config_class(self) if getattr(self, "generic", False) else zoo_classes(self)
        peft_names.register(self)


def _rename(key: str, table: dict[str, str]) -> str:
    for old, new in table.items():
        if key.startswith(old):
            return new + key[len(old):]
    return key
