"""A model family spec: where the MoE blocks are, how their weights map, which router they use."""
from __future__ import annotations

import torch

from zoo.layout import build_block


class NotExportable(ValueError):
    """The layout cannot be written in the family's native format."""


class NotConvertible(TypeError):
    """A native model (or block) the zoo cannot hold without changing what it computes; the message says why."""


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
    auto = "causal-lm"  # the Auto class users load the family with ("causal-lm" or "image-text-to-text")
    zoo_forward = True  # the zoo's causal-LM forward (balance loss over layers that may differ) replaces the family's
    layers_path = "layers"  # the decoder layers, below the base model
    block_attr = "mlp"  # a decoder layer's attribute holding the MoE block

    def matches(self, model) -> bool:
        """Whether ``model`` is a native model of this family."""
        return isinstance(model, self.model_class)

    def text_config(self, config):
        """The config that holds the decoder's MoE keys (a vision-language config's text part)."""
        return config

    def discover(self, base) -> None:
        """Read where the blocks are off a base model (first-party specs know it already)."""

    # ---- structure -------------------------------------------------------------------------------
    def moe_layer_ids(self, config) -> list[int]:
        return list(range(config.num_hidden_layers))

    def router_options(self, config) -> dict:
        return {k: getattr(config, k) for k in self.router_config_keys}

    def experts_options(self, config) -> dict:
        return {"activation": "silu", "bias": False}

    def shared_options(self, config) -> dict | None:
        return None

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
    def native_config(self, config, layout: list[dict | None]):
        """The native config that expresses ``layout``, or NotExportable with the reason."""
        moe = {i: e for i, e in enumerate(layout) if e}
        if not moe:
            raise NotExportable("the model has no MoE layer")
        self._check_exportable_parts(config)
        first_i, first = next(iter(moe.items()))
        for i, e in moe.items():
            if (e["num_experts"], e["num_experts_per_tok"]) != (first["num_experts"], first["num_experts_per_tok"]):
                raise NotExportable(
                    f"layer {i} has {e['num_experts']} experts and top-{e['num_experts_per_tok']} but layer "
                    f"{first_i} has {first['num_experts']} and top-{first['num_experts_per_tok']}: a native "
                    f"{self.name} config holds one expert count and k for all layers")
        values = {k: v for k, v in config.to_dict().items() if k in self.config_class.__dataclass_fields__}
        values.update({self.num_experts_key: first["num_experts"], "num_experts_per_tok": first["num_experts_per_tok"],
                       self.intermediate_key: first["experts_options"].get("intermediate_size")})
        values.update({k: first["router_options"][k] for k in self.router_config_keys if k in first["router_options"]})
        native = self.config_class(**values)
        want = set(self.moe_layer_ids(native))
        if want != set(moe):
            raise NotExportable(f"MoE layers {sorted(moe)} differ from the native pattern {sorted(want)}")
        expected = self.block_layout(native)
        for i, e in moe.items():
            for key in expected:
                if e.get(key) != expected[key]:
                    raise NotExportable(f"layer {i}: {key} is {e.get(key)!r}, the native {self.name} block "
                                        f"needs {expected[key]!r}")
        return native

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

    def register_auto_classes(self) -> None:
        from zoo.architectures.factory import zoo_classes, zoo_config_class

        zoo_config_class(self) if getattr(self, "generic", False) else zoo_classes(self)


def _rename(key: str, table: dict[str, str]) -> str:
    for old, new in table.items():
        if key.startswith(old):
            return new + key[len(old):]
    return key
