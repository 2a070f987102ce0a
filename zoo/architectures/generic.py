"""The generic family adapter: a transformers MoE family whose blocks hold transformers' fused experts (the
``@use_experts_implementation`` classes) and a top-k router converts without code of its own.

Everything is read off the family's own modules: where the blocks sit (``model.<layers>.<i>.<attr>``), the
experts' layout flags (transposed, biases, activation), the shared experts, and the routing rule. The rule is
found by running the family's block with its experts replaced by a recorder: the (indices, weights) it hands
its experts are compared with the zoo's routers under the options the config allows, and the first exact
match is kept (``topk-softmax`` or ``sigmoid-bias`` where they fit, else ``scored-topk``). A block with a part
the zoo cannot hold is refused with ``NotConvertible`` naming it.
"""
from __future__ import annotations

import copy
import itertools
import json
import re

import torch
from torch import nn

from zoo.architectures.family import Family, NotConvertible, NotExportable
from zoo.moe.layout import build_block

E_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
K_KEYS = ("num_experts_per_tok", "moe_k", "moe_topk", "top_k")
SCALE_KEYS = ("routed_scaling_factor", "route_scale", "moe_routed_scaling_factor", "router_scaling_factor")
SOFTCAP_KEYS = ("router_logit_softcapping",)
ACT_KEYS = ("hidden_act", "moe_hidden_act", "hidden_activation")
PROBE_TOKENS = 64
ROLE_KEYS = {"weight": "router.weight", "logit": "router.bias", "selection": "router.e_score_correction_bias"}
AUTO_NAMES = {"causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
              "image-text-to-text": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
              "multimodal-lm": "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES"}


class _Captured(Exception):
    def __init__(self, indices, weights):
        super().__init__("routing captured")
        self.indices, self.weights = indices, weights


class _Capture(nn.Module):
    """Stands in for the experts during the probe: records what the block routes, then stops the block."""

    def forward(self, hidden, top_k_index=None, top_k_weights=None, *args, **kwargs):
        if top_k_index is None or top_k_weights is None:
            raise NotConvertible("the block calls its experts without (indices, weights)")
        raise _Captured(top_k_index, top_k_weights)


class _Zero(nn.Module):
    def forward(self, x, *args, **kwargs):
        return torch.zeros_like(x)


def activation_name(act, config, ungated: bool = False) -> str:
    """The name of a transformers activation module: among the zoo's GLU activations, or (``ungated``, for
    ``mlp`` experts and ungated shared MLPs) any of transformers'."""
    from transformers.activations import ACT2FN

    from zoo.moe.experts import ACTIVATIONS, PARAMETERS

    names = ([n for n in ACT2FN if isinstance(n, str)] if ungated
             else [n for n in ACTIVATIONS if n not in PARAMETERS])

    plain = {torch.nn.functional.silu: "silu", torch.nn.functional.gelu: "gelu", torch.nn.functional.relu: "relu",
             torch.tanh: "tanh"}
    if act in plain:
        return plain[act]
    for key in (*ACT_KEYS, "mlp_hidden_act"):
        name = getattr(config, key, None)
        if isinstance(name, str) and name in names and type(ACT2FN[name]) is type(act):
            return name
    for name in names:
        if type(ACT2FN[name]) is type(act):
            return name
    raise NotConvertible(f"activation {type(act).__name__} has no zoo counterpart")


def _linear(m, bias=False) -> bool:
    return isinstance(m, nn.Linear) and (m.bias is not None) == bias


class GenericFamily(Family):
    """One transformers MoE family, by model type. ``auto`` names the Auto class users load it with."""

    zoo_forward = False  # the family's own forward (logit scaling, soft-capping, ...) stays
    generic = True

    def __init__(self, model_type: str, auto: str = "causal-lm", summary: str = "", paper: str = ""):
        self.name = model_type
        self.auto = auto
        self.summary = summary or f"{model_type} decoder, converted by the generic family adapter."
        self.paper = paper
        self.layers_path, self.block_attr, self.block_class = None, None, None
        self._specs: dict[str, dict] = {}  # by text config: the same for every block of one config

    # ---- the family's own classes, imported on first use --------------------------------------------------
    @property
    def config_class(self):
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        return CONFIG_MAPPING[self.name]

    @property
    def model_class(self):
        import transformers
        from transformers.models.auto import modeling_auto

        return getattr(transformers, getattr(modeling_auto, AUTO_NAMES[self.auto])[self.name])

    def matches(self, model) -> bool:
        config = getattr(model, "config", None)
        return getattr(config, "model_type", None) == self.name and type(model).__name__ == self.model_class.__name__

    def text_config(self, config):
        return config.get_text_config()

    # ---- where the blocks are -------------------------------------------------------------------------------
    def discover(self, base) -> None:
        """Find the MoE blocks below ``base`` (the family's base model): their class, layer list and attribute."""
        if self.block_class is not None:
            return
        found = {}
        for path, module in base.named_modules():
            experts = getattr(module, "experts", None)
            if isinstance(experts, nn.Module) and fused_flags(experts) and not path.endswith("experts"):
                match = re.fullmatch(r"(.+)\.(\d+)\.(\w+)", path)
                if match:
                    found.setdefault((match[1], match[3], type(module)), path)
        if not found:
            raise NotConvertible(f"{self.name}: no block holds transformers' fused experts "
                                 "(`@use_experts_implementation`)")
        if len(found) > 1:  # e.g. a vision tower with MoE blocks of its own: the language model's are converted
            found = {key: path for key, path in found.items() if key[0].startswith("language_model.")}
        if len(found) != 1:
            raise NotConvertible(f"{self.name}: MoE blocks in several places ({sorted(found.values())})")
        (self.layers_path, self.block_attr, self.block_class), = found

    # ---- one block ------------------------------------------------------------------------------------------
    def spec(self, block, config) -> dict:
        """The layout entry and key names of a native block (same for every block of one config and clamp limits)."""
        text = self.text_config(config)
        key = json.dumps([text.to_dict(), _clamp_limits(block)], sort_keys=True, default=str)
        if key not in self._specs:
            self._specs[key] = block_spec(block, text)
        return self._specs[key]

    def block_layout(self, config) -> dict:
        _, blocks = self._meta_blocks(config)
        return self.spec(blocks[0], config)["entry"]

    def moe_layer_ids(self, config) -> list[int]:
        return self._meta_blocks(config)[0]

    def _meta_blocks(self, config) -> tuple[list[int], list]:
        """(MoE layer ids, their blocks) of the family's model for ``config``, built on the meta device."""
        with torch.device("meta"):
            model = self.model_class(config)
        self.discover(model.model)
        found = [(i, getattr(layer, self.block_attr, None))
                 for i, layer in enumerate(model.model.get_submodule(self.layers_path))]
        found = [(i, block) for i, block in found if isinstance(block, self.block_class)]
        if not found:
            raise NotConvertible(f"{self.name}: this config has no MoE layer")
        return [i for i, _ in found], [block for _, block in found]

    def from_native(self, block, config):
        spec = self.spec(block, config)
        with torch.device("meta"):
            moe = build_block(spec["entry"])
        moe.load_state_dict(self.block_state(block.state_dict(), spec), strict=True, assign=True)
        if not spec.get("verified") and _real_fp32(block):
            _verify(block, moe)
            spec["verified"] = True
        return moe

    def block_state(self, sd: dict, spec: dict) -> dict:
        """A native block's tensors under the zoo block's names (the spec read off that block)."""
        return block_to_zoo(sd, spec)

    def to_zoo_state(self, sd: dict) -> dict:
        return block_to_zoo(sd, self._last_spec())

    def to_native_state(self, sd: dict) -> dict:
        return block_to_native(sd, self._last_spec())

    def _last_spec(self) -> dict:
        """The spec read last (export reads the native config's first): key names are the family's structure."""
        if not self._specs:
            raise NotExportable(f"{self.name}: no block has been read yet (export calls native_config first)")
        return list(self._specs.values())[-1]

    # ---- export -----------------------------------------------------------------------------------------------
    def uniform_entry(self, config, layout) -> tuple[int, dict, dict]:
        """(first MoE layer, its entry, {layer: entry}) of a layout a native config can hold (one block shape for all
        MoE layers, no zoo-only parts), else NotExportable."""
        moe = {i: e for i, e in enumerate(layout) if e}
        if not moe:
            raise NotExportable("the model has no MoE layer")
        Family._check_exportable_parts(self, config)
        first_i, first = next(iter(moe.items()))
        for i, e in moe.items():
            if e != first:
                raise NotExportable(f"layer {i} differs from layer {first_i} ({first_difference(e, first)}): a "
                                    f"native {self.name} config holds one block shape for all layers")
        return first_i, first, moe

    def native_config(self, config, layout):
        """The native config for ``layout``: one expert count and k for all MoE layers (what a native config holds),
        and each layer's block as the native block at that layer (which may differ per layer: Step 3.7's clamps)."""
        moe = {i: e for i, e in enumerate(layout) if e}
        if not moe:
            raise NotExportable("the model has no MoE layer")
        Family._check_exportable_parts(self, config)
        first_i, first = next(iter(moe.items()))
        def size(e):
            return e["num_experts"], e["num_experts_per_tok"], e["experts_options"].get("intermediate_size")

        for i, e in moe.items():
            if size(e) != size(first):
                raise NotExportable(f"layer {i} differs from layer {first_i} ({first_difference(e, first)}): a "
                                    f"native {self.name} config holds one expert count, k and expert size")
        values = {k: v for k, v in config.to_dict().items() if not k.startswith("zoo_") and k != "model_type"}
        text_values = values.get("text_config", values) if self.text_config(config) is not config else values
        text = self.text_config(config)
        for keys, new in ((E_KEYS, first["num_experts"]), (K_KEYS, first["num_experts_per_tok"])):
            for k in keys:
                if getattr(text, k, None) is not None and not isinstance(getattr(text, k), bool):
                    text_values[k] = new
        try:
            native = self.config_class(**values)
            ids, blocks = self._meta_blocks(native)
            expected = {i: self.spec(block, native)["entry"] for i, block in zip(ids, blocks)}
        except Exception as exc:  # the config class's own validators, or a probe of the block it builds
            raise NotExportable(f"a native {self.name} config cannot hold {first['num_experts']} experts, "
                                f"top-{first['num_experts_per_tok']}: {exc}") from None
        if expected[ids[0]]["experts_options"].get("intermediate_size") != \
                first["experts_options"].get("intermediate_size"):
            raise NotExportable("the experts' intermediate size differs from the native config's")
        if set(expected) != set(moe):
            raise NotExportable(f"MoE layers {sorted(moe)} differ from the native pattern {sorted(expected)}")
        for i, e in moe.items():
            if e != expected[i]:
                raise NotExportable(f"layer {i}: {first_difference(e, expected[i])}")
        return native


class RenamedBlockFamily(GenericFamily):
    """A generic family whose block a function of its own reads (``read_block(block, text_config)`` -> layout entry)
    and whose tensors map to the zoo block's by a fixed table (``renames``: native key -> zoo key)."""

    renames: dict[str, str] = {}
    label = ""  # the family's name in messages

    @staticmethod
    def read_block(block, config) -> dict:
        raise NotImplementedError

    def spec(self, block, config) -> dict:
        text = self.text_config(config)
        key = json.dumps(text.to_dict(), sort_keys=True, default=str)
        if key not in self._specs:
            self._specs[key] = {"entry": self.read_block(block, text)}
        return self._specs[key]

    def block_state(self, sd: dict, spec: dict) -> dict:
        return self.to_zoo_state(sd)

    def to_zoo_state(self, sd: dict) -> dict:
        unknown = sorted(set(sd) - set(self.renames))
        if unknown:
            raise NotConvertible(f"{self.label} MoE tensors with no zoo counterpart: {unknown}")
        return {self.renames[k]: v for k, v in sd.items()}

    def to_native_state(self, sd: dict) -> dict:
        back = {zoo: native for native, zoo in self.renames.items()}
        unknown = sorted(set(sd) - set(back))
        if unknown:
            raise NotExportable(f"{unknown[0]} has no place in a native {self.label} block")
        return {back[k]: v for k, v in sd.items()}

    # ---- export -----------------------------------------------------------------------------------------------
    def native_values(self, values: dict, first: dict, config) -> dict | None:
        """The native config's values (``values``: the zoo config's own) for a layout whose MoE layers all hold
        ``first``: the family's expert count, k and expert size set from it. None: the generic adapter's way."""
        return None

    def native_config(self, config, layout):
        first_i, first, moe = self.uniform_entry(config, layout)
        values = {key: v for key, v in config.to_dict().items() if not key.startswith("zoo_") and key != "model_type"}
        values = self.native_values(values, first, config)
        if values is None:
            return super().native_config(config, layout)
        try:
            native = self.config_class(**values)
            ids, blocks = self._meta_blocks(native)
            expected = self.spec(blocks[0], native)["entry"]
        except Exception as exc:  # the config class's own validators, or a block it cannot build
            raise NotExportable(f"a native {self.label} config cannot hold {first['num_experts']} experts, "
                                f"top-{first['num_experts_per_tok']}: {exc}") from None
        if set(ids) != set(moe):
            raise NotExportable(f"MoE layers {sorted(moe)} differ from the native pattern {sorted(ids)}")
        if first != expected:
            raise NotExportable(f"layer {first_i}: {first_difference(first, expected)}")
        return native


def recorded_entry(entry: dict, label: str) -> dict:
    """A layout entry as a block built from it records itself (built on meta: its components' own checks run),
    or NotConvertible naming the family."""
    try:
        with torch.device("meta"):
            return build_block(entry).layout()
    except ValueError as exc:
        raise NotConvertible(f"{label} MoE block: {exc}") from None


def first_difference(a: dict, b: dict) -> str:
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            return f"{key} is {a.get(key)!r}, the native block needs {b.get(key)!r}"
    return "same"


def _real_fp32(block) -> bool:
    tensors = list(block.parameters())
    return bool(tensors) and all(t.device.type != "meta" and t.dtype == torch.float32 for t in tensors)


def _verify(native, moe) -> None:
    """The converted block computes what the native one does (on random tokens, in fp32)."""
    device = next(native.parameters()).device
    x = torch.randn(1, 16, moe.router.hidden_size, generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        want, got = native(x), moe(x)
    want = want[0] if isinstance(want, tuple) else want
    got = got[0] if isinstance(got, tuple) else got
    err = ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
    if not err <= 1e-4:
        raise NotConvertible(f"the converted block differs from {type(native).__name__} (relative error {err:.2e}): "
                             "the family's block does something the zoo's block does not")


# ---- reading a native block --------------------------------------------------------------------------------------
def block_spec(block, config) -> dict:
    """How a native MoE block maps onto the zoo's: router rule and options, experts' layout, the renames, splits and
    shapes that ``block_to_zoo`` / ``block_to_native`` apply (raises NotConvertible where it has no zoo form)."""
    children = dict(block.named_children())
    experts = children.get("experts")
    experts_kind, entry_experts, expert_keys, transposed = _experts_spec(experts, config)
    E, H = entry_experts["num_experts"], entry_experts["hidden_size"]
    router_name = _router_child(block, E, H)
    norm_name, norm = _output_norm(children, router_name, H)
    if norm_name:
        children = {n: c for n, c in children.items() if n != norm_name}
    shared, shared_keys, splits = _shared_spec(children, router_name, H, config)
    gate_name, tensors = _router_tensors(block, router_name, E, H, {**shared_keys, **splits})
    router, router_options, k, roles = _probe(block, router_name, config, E, H, gate_name, tensors)
    scale = _routed_output_scale(block, router_name, H, norm_name)
    if scale != 1.0:  # the block scales the experts' summed output (e.g. by routed_scaling_factor): same as the weights
        router, router_options = scale_routing(router, router_options, scale)
    renames = {**expert_keys, **shared_keys}
    if norm_name:
        renames[f"{norm_name}.weight"] = "output_norm.weight"
    shapes = {}
    for name, role in roles.items():
        renames[name] = ROLE_KEYS[role]
        if role != "weight":
            shapes[name] = list(tensors[name].shape)
    leftover = set(block.state_dict()) - set(renames) - set(splits)
    if leftover:
        raise NotConvertible(f"block tensors with no zoo counterpart: {sorted(leftover)}")
    entry = {"num_experts": E, "num_experts_per_tok": k, "router": router, "router_options": router_options,
             "experts": experts_kind, "experts_options": entry_experts, "shared_experts": shared,
             "returns_router_scores": False, **({"output_norm": norm} if norm_name else {})}
    return {"entry": entry, "renames": renames, "shapes": shapes, "transposed": transposed, "splits": splits}


def fused_flags(experts) -> dict | None:
    """The layout flags of transformers' fused experts: those the ``@use_experts_implementation`` decorator sets,
    or, for an undecorated class holding exactly the fused stacks (Step 3.7: ``gate_up_proj`` [E, 2I, H] and
    ``down_proj`` [E, H, I], an ``act_fn``), the flags of that layout; None for anything else. An undecorated class
    is taken at its shapes; the converted block is checked against it wherever its weights are real fp32
    (``_verify``), which the families test does on the family's tiny model."""
    if hasattr(experts, "has_gate"):
        return {k: bool(getattr(experts, k, False)) for k in
                ("has_gate", "is_concatenated", "is_transposed", "has_bias", "has_post_expert_norm")}
    tensors = dict(itertools.chain(experts.named_parameters(), experts.named_buffers()))
    gate_up, down = tensors.get("gate_up_proj"), tensors.get("down_proj")
    if set(tensors) != {"gate_up_proj", "down_proj"} or gate_up.dim() != 3 or down.dim() != 3 \
            or not hasattr(experts, "act_fn"):
        return None
    E, two_i, H = gate_up.shape
    if two_i % 2 or tuple(down.shape) != (E, H, two_i // 2):
        return None
    return {"has_gate": True, "is_concatenated": True, "is_transposed": False, "has_bias": False,
            "has_post_expert_norm": False}


def _clamp_limits(block) -> list:
    """The clamp limits the block's modules hold, which families set per layer (Step 3.7's ``swiglu_limits``)."""
    return [(name, float(m.limit)) for name, m in block.named_modules()
            if isinstance(getattr(m, "limit", None), (int, float)) and not isinstance(m.limit, bool)]


def _experts_spec(experts, config):
    from transformers.integrations.moe import _default_apply_gate

    flags = fused_flags(experts) if experts is not None else None
    if not flags:
        raise NotConvertible("the block's experts are not transformers' fused experts")
    if not flags["has_gate"]:
        return _ungated_spec(experts, config)
    if not flags["is_concatenated"]:
        raise NotConvertible(f"{type(experts).__name__} interleaves gate and up rows")
    if flags["has_post_expert_norm"]:
        raise NotConvertible(f"{type(experts).__name__} normalises each expert's output")
    names = {n for n, _ in experts.named_parameters()} | {n for n, _ in experts.named_buffers()}
    allowed = {"gate_up_proj", "down_proj"} | ({"gate_up_proj_bias", "down_proj_bias"} if flags["has_bias"] else set())
    if names != allowed:
        raise NotConvertible(f"{type(experts).__name__} holds {sorted(names - allowed) or sorted(allowed - names)}")
    gate_up = experts.gate_up_proj
    transposed = flags["is_transposed"]
    E = gate_up.shape[0]
    H, two_i = (gate_up.shape[1], gate_up.shape[2]) if transposed else (gate_up.shape[2], gate_up.shape[1])
    options = {"num_experts": E, "hidden_size": H, "intermediate_size": two_i // 2, "bias": flags["has_bias"]}
    if getattr(type(experts), "_apply_gate", _default_apply_gate) is _default_apply_gate:
        options["activation"] = activation_name(experts.act_fn, config)
    else:
        options.update(_gate_function(experts, config, two_i))
    keys = {f"experts.{n}": f"experts.{n}" for n in allowed}
    return "swiglu", options, keys, transposed


def _ungated_spec(experts, config):
    """Experts with up and down projections only (Nemotron-H): the zoo's ``mlp`` experts."""
    names = {n for n, _ in experts.named_parameters()} | {n for n, _ in experts.named_buffers()}
    if names != {"up_proj", "down_proj"} or experts.is_transposed or getattr(experts, "has_post_expert_norm", False):
        raise NotConvertible(f"{type(experts).__name__}: ungated experts holding {sorted(names)}"
                             f"{' (transposed)' if experts.is_transposed else ''}; the zoo's mlp experts hold "
                             "up_proj [E, I, H] and down_proj [E, H, I]")
    E, I, H = experts.up_proj.shape
    options = {"num_experts": E, "hidden_size": H, "intermediate_size": I,
               "activation": activation_name(experts.act_fn, config, ungated=True)}
    return "mlp", options, {"experts.up_proj": "experts.up_proj", "experts.down_proj": "experts.down_proj"}, False


def _gate_function(experts, config, two_i) -> dict:
    """The zoo activation that computes a family's own ``_apply_gate`` (found on random inputs, beyond any clamp)."""
    from zoo.moe.experts import ACTIVATIONS, PARAMETERS

    x = torch.randn(64, two_i, generator=torch.Generator().manual_seed(0)) * 8
    with torch.no_grad():
        want = experts._apply_gate(x)
    # an activation's two parameters, from where families keep them (see zoo.moe.experts.PARAMETERS)
    limits = {float(v) for v in (getattr(experts, "limit", None), getattr(config, "swiglu_limit", None),
                                 getattr(experts, "swiglu_limit", None), getattr(config, "mlp_gate_softcap", None))
              if isinstance(v, (int, float))}
    alphas = {float(v) for v in (getattr(experts, "alpha", None), getattr(config, "swiglu_alpha", None),
                                 getattr(config, "mlp_up_softcap", None)) if isinstance(v, (int, float))}
    gate, up = x.chunk(2, dim=-1)
    for name, fn in ACTIVATIONS.items():
        for limit, alpha in itertools.product(sorted(limits) or [7.0], sorted(alphas) or [1.702]):
            if want.shape == gate.shape and torch.allclose(fn(gate, up, limit, alpha), want, rtol=1e-5, atol=1e-6):
                values = {"swiglu_limit": limit, "swiglu_alpha": alpha}
                return {"activation": name, **{k: values[k] for k in PARAMETERS.get(name, ())}}
    raise NotConvertible(f"{type(experts).__name__} gates with a function none of the zoo's activations computes")


def _output_norm(children, router_name, H) -> tuple[str | None, dict | None]:
    """The block's RMS norm child (A.X-K1's ``post_mlp_layernorm``), taken as a norm on the block's output (the
    only place a family puts one); the converted block is checked against the native one (``_verify``) when its
    weights are real fp32, so a norm elsewhere is refused there."""
    from zoo.moe.norms import as_block_norm

    found = {n: as_block_norm(c, H) for n, c in children.items() if n not in ("experts", router_name)}
    found = {n: options for n, options in found.items() if options}
    if len(found) > 1:
        raise NotConvertible(f"several norms in the block ({', '.join(sorted(found))}); the zoo block holds one on "
                             "its output")
    return next(iter(found.items()), (None, None))


def _router_child(block, E, H) -> str:
    for name, child in block.named_children():
        if name != "experts" and any(t.shape == (E, H) for t in child.parameters()):
            return name
    raise NotConvertible(f"no router with a [{E}, {H}] gate in {type(block).__name__}")


def _shared_spec(children, router_name, H, config):
    """The always-on shared MLP (and its sigmoid gate), or None; parts the zoo cannot hold are refused."""
    rest = {n: c for n, c in children.items() if n not in ("experts", router_name) and not isinstance(c, nn.Identity)}
    mlp = {n: c for n, c in rest.items()
           if all(_linear(getattr(c, p, None)) for p in ("up_proj", "down_proj"))
           and (getattr(c, "gate_proj", None) is None or _linear(c.gate_proj))
           and set(dict(c.named_children())) <= {"gate_proj", "up_proj", "down_proj", "act_fn", "activation_fn"}}
    fused = {n: c for n, c in rest.items()
             if _linear(getattr(c, "gate_up_proj", None)) and _linear(getattr(c, "down_proj", None))
             and set(dict(c.named_children())) <= {"gate_up_proj", "down_proj", "act_fn"}}
    if len(fused) == 1 and not mlp and not (set(rest) - set(fused)):
        return _fused_shared_spec(*next(iter(fused.items())), H, config)
    gate = {n: c for n, c in rest.items() if _linear(c) and c.weight.shape == (1, H)}
    other = set(rest) - set(mlp) - set(gate)
    if other or len(mlp) > 1 or len(gate) > len(mlp):
        parts = sorted(f"{n} ({type(rest[n]).__name__})" for n in (other or rest))
        raise NotConvertible(f"block parts with no zoo counterpart: {', '.join(parts)}")
    if not mlp:
        return None, {}, {}
    (name, m), = mlp.items()
    glu = getattr(m, "gate_proj", None) is not None
    act = getattr(m, "act_fn", None) or getattr(m, "activation_fn", None)
    options = {"hidden_size": H, "intermediate_size": m.up_proj.out_features, "gated": False}
    act_name = "silu" if act is None else activation_name(act, config, ungated=not glu)
    if act_name != "silu":
        options["activation"] = act_name
    if not glu:
        options["glu"] = False
    options = {**_mlp_function(m, options, H, config), "gated": bool(gate)}
    projections = ("gate_proj", "up_proj", "down_proj") if glu else ("up_proj", "down_proj")
    keys = {f"{name}.{p}.weight": f"shared_experts.{p}.weight" for p in projections}
    if gate:
        keys[f"{next(iter(gate))}.weight"] = "shared_experts.gate.weight"
    return options, keys, {}


def _random_twin(m, H):
    """(an fp32 copy of ``m`` on random weights, random tokens, its output on them): the real weights may be bf16
    or on meta, and a function is told apart best where its clamps bite (inputs scaled up)."""
    gen = torch.Generator().manual_seed(0)
    twin = copy.deepcopy(m)
    twin = twin.to_empty(device="cpu") if any(t.is_meta for t in twin.parameters()) else twin
    twin = twin.float()
    with torch.no_grad():
        for t in twin.parameters():
            t.copy_(torch.randn(t.shape, generator=gen) / t.shape[-1] ** 0.5)
        x = torch.randn(1, 16, H, generator=gen) * 4
        return twin, x, twin(x)


def _matching_shared(twin, x, want, candidates, load):
    """The first SharedMLP options among ``candidates`` whose module (weights set by ``load``) computes ``want``."""
    from zoo.moe import SharedMLP

    for options in candidates:
        shared = SharedMLP(**options)
        with torch.no_grad():
            load(shared, twin)
            if torch.allclose(shared(x), want, rtol=1e-5, atol=1e-6):
                return shared.options()
    return None


def _limits_and_alphas(m, config):
    limits = {float(v) for v in (getattr(m, "limit", None), getattr(m, "swiglu_limit", None),
                                 getattr(config, "swiglu_limit", None))
              if isinstance(v, (int, float)) and not isinstance(v, bool)} or {7.0}
    alphas = {float(v) for v in (getattr(m, "swiglu_alpha", None), getattr(config, "swiglu_alpha", None))
              if isinstance(v, (int, float)) and not isinstance(v, bool)} or {1.702}
    return sorted(limits), sorted(alphas)


def _glu_candidates(base, m, config):
    """``base`` first, then each of the zoo's GLU activations under the clamp limits the module or config holds."""
    from zoo.moe.experts import ACTIVATIONS

    yield base
    limits, alphas = _limits_and_alphas(m, config)
    for activation, limit, alpha in itertools.product(ACTIVATIONS, limits, alphas):
        yield {**base, "activation": activation, "swiglu_limit": limit, "swiglu_alpha": alpha}


def _mlp_function(m, options, H, config) -> dict:
    """``options`` of a shared MLP read off its parts, checked on random tokens against what the module computes; a
    gated MLP whose forward does more (Step 3.7 clamps after the SiLU) gets the zoo activation that matches."""
    twin, x, want = _random_twin(m, H)
    glu = options.get("glu", True)

    def load(shared, twin):
        for p in ("gate_proj", "up_proj", "down_proj") if glu else ("up_proj", "down_proj"):
            getattr(shared, p).weight.copy_(getattr(twin, p).weight)

    found = _matching_shared(twin, x, want, _glu_candidates(options, m, config) if glu else [options], load)
    if found is None:
        raise NotConvertible(f"shared experts {type(m).__name__}: a function none of the zoo's activations computes")
    return found


def _fused_shared_spec(name, m, H, config):
    """A shared MLP with one fused gate/up projection (MiniMax-M3): its gate function found on random tokens
    among the zoo's GLU activations; the fused weight splits into the zoo's gate and up projections."""
    twin, x, want = _random_twin(m, H)

    def load(shared, twin):
        gate_w, up_w = twin.gate_up_proj.weight.chunk(2, dim=0)
        shared.gate_proj.weight.copy_(gate_w)
        shared.up_proj.weight.copy_(up_w)
        shared.down_proj.weight.copy_(twin.down_proj.weight)

    base = {"hidden_size": H, "intermediate_size": m.down_proj.in_features, "gated": False}
    options = _matching_shared(twin, x, want, list(_glu_candidates(base, m, config))[1:], load)
    if options is None:
        raise NotConvertible(f"shared experts {type(m).__name__}: a gate function none of the zoo's activations "
                             "computes")
    return options, {f"{name}.down_proj.weight": "shared_experts.down_proj.weight"}, {
        f"{name}.gate_up_proj.weight": ["shared_experts.gate_proj.weight", "shared_experts.up_proj.weight"]}


def _router_tensors(block, router_name, E, H, shared_keys):
    """The router's tensors, by state-dict name: its [E, H] gate and per-expert vectors (on the router or the
    block itself); anything else is refused."""
    tensors = {}
    for name, t in itertools.chain(block.named_parameters(), block.named_buffers()):
        if name.startswith("experts.") or name in shared_keys:
            continue
        if name.startswith(f"{router_name}.") or "." not in name:
            tensors[name] = t
    gates = [n for n, t in tensors.items() if t.shape == (E, H)]
    vectors = [n for n, t in tensors.items() if t.numel() == E and n not in gates]
    other = sorted(set(tensors) - set(gates) - set(vectors))
    if len(gates) != 1 or len(vectors) > 2 or other:
        raise NotConvertible(f"router tensors the zoo's routers do not hold: {other or sorted(tensors)}")
    return gates[0], tensors


def _candidates(config, E, vectors):
    """Option sets the config allows, simplest first."""
    scales = [1.0] + [float(getattr(config, k)) for k in SCALE_KEYS
                      if isinstance(getattr(config, k, None), (int, float)) and getattr(config, k) not in (1, 1.0)]
    groups = [(1, 1, "top2", "-inf")]
    n_group = getattr(config, "n_group", None) or getattr(config, "num_expert_group", None)
    topk_group = getattr(config, "topk_group", None)
    if isinstance(n_group, int) and n_group > 1 and isinstance(topk_group, int) and E % n_group == 0:
        groups += [(n_group, topk_group, score, fill) for fill in ("-inf", "zero") for score in ("top2", "max")]
    caps = [0.0] + [float(getattr(config, k)) for k in SOFTCAP_KEYS if (getattr(config, k, None) or 0) > 0]
    role_sets = [dict(zip(vectors, roles)) for roles in itertools.product(("logit", "selection"), repeat=len(vectors))
                 if len(set(roles)) == len(roles)]
    for roles, score, norm, scale, (n, tk, gs, fill), cap, bias_on in itertools.product(
            role_sets, ("softmax", "sigmoid"), (True, False), scales, groups, caps, ("scores", "logits")):
        if bias_on == "logits" and "selection" not in roles.values():
            continue
        yield roles, {"score": score, "norm_topk_prob": norm, "routed_scaling_factor": scale,
                      "selection_bias": "selection" in roles.values(), "n_group": n, "topk_group": tk,
                      "group_score": gs, "logit_softcap": cap, "bias_on": bias_on, "bias": "logit" in roles.values(),
                      **({"group_fill": fill} if fill != "-inf" else {})}


def _probe(block, router_name, config, E, H, gate_name, tensors):
    """Run the block's own routing on random tokens (experts and shared parts stubbed out) and find the zoo
    router that reproduces it."""
    from zoo.components.registry import registry

    twin = _routing_twin(block, router_name)
    gen = torch.Generator().manual_seed(0)
    values = {}
    with torch.no_grad():
        for name, t in itertools.chain(twin.named_parameters(), twin.named_buffers()):
            if name == gate_name:
                new = torch.randn(t.shape, generator=gen) / H ** 0.5
            elif name in tensors:
                new = torch.randn(t.shape, generator=gen) * 0.5
            else:
                continue
            t.data = new.to(torch.float32)
            values[name] = t.data
        x = torch.randn(1, PROBE_TOKENS, H, generator=gen)
        try:
            twin(x)
        except _Captured as cap:
            indices, weights = cap.indices.long().reshape(PROBE_TOKENS, -1), cap.weights.float()
        except NotConvertible:
            raise
        except Exception as exc:
            raise NotConvertible(f"{type(block).__name__} could not be probed: {type(exc).__name__}: {exc}") from None
        else:
            raise NotConvertible(f"{type(block).__name__} never called its experts")
    k = indices.shape[1]
    weights = weights.reshape(PROBE_TOKENS, -1)
    if weights.shape[1] == E and k != E:  # dense [T, E] scores
        weights = weights.gather(1, indices)
    vectors = [n for n in tensors if n != gate_name]
    scored = registry.get("router", "scored-topk").obj
    for roles, options in _candidates(config, E, vectors):
        try:
            router = scored(H, E, k, **options)
        except ValueError:
            continue
        _load_router(router, values, gate_name, roles)
        with torch.no_grad():
            routing = router(x[0])
        if _same_routing(indices, weights, routing):
            name, opts = _simplest(options)
            simple = registry.get("router", name).obj(H, E, k, **opts)
            _load_router(simple, values, gate_name, roles)
            with torch.no_grad():
                if not _same_routing(indices, weights, simple(x[0])):
                    name, opts = "scored-topk", options
            return name, opts, k, {gate_name: "weight", **roles}
    for name, opts in _other_rules(config):  # families that route in a way of their own
        router = registry.get("router", name).obj(H, E, k, **opts)
        _load_router(router, values, gate_name, {})
        with torch.no_grad():
            if not vectors and _same_routing(indices, weights, router(x[0])):
                return name, dict(router.options), k, {gate_name: "weight"}
    raise NotConvertible(f"{type(block).__name__}'s routing matches none of the zoo's top-k rules "
                         "(softmax/sigmoid, selection bias, groups, renormalisation, scaling)")


def _other_rules(config):
    jitter = getattr(config, "router_jitter_noise", None)
    if isinstance(jitter, (int, float)) and not isinstance(jitter, bool):
        yield "sparsemixer", {"jitter_eps": float(jitter)}


class _Ones(nn.Module):
    def forward(self, hidden, *args, **kwargs):
        return torch.ones_like(hidden)


def _routed_output_scale(block, router_name, H, norm_name=None) -> float:
    """What the block does to its experts' output: experts that return ones, other parts zeros (its output norm
    left out); the block's output is then the factor it applies (1.0 for most families)."""
    twin = _routing_twin(block, router_name, experts=_Ones(), identity=norm_name)
    with torch.no_grad():
        try:
            out = twin(torch.randn(1, 8, H, generator=torch.Generator().manual_seed(0)))
        except Exception as exc:
            raise NotConvertible(f"{type(block).__name__} could not be probed: {type(exc).__name__}: {exc}") from None
    out = (out[0] if isinstance(out, tuple) else out).float()
    scale = out.mean().item()
    if not torch.allclose(out, torch.full_like(out, scale), rtol=1e-6, atol=1e-7):
        raise NotConvertible(f"{type(block).__name__} transforms its experts' output beyond a scale factor")
    return 1.0 if abs(scale - 1.0) <= 1e-7 else scale


def scale_routing(router: str, options: dict, factor: float) -> tuple[str, dict]:
    """The routing rule with its weights multiplied by ``factor`` (a ``scored-topk`` rule where needed)."""
    if router == "topk-softmax":
        router, options = "scored-topk", {
            "score": "softmax", "norm_topk_prob": options["norm_topk_prob"], "routed_scaling_factor": 1.0,
            "selection_bias": False, "n_group": 1, "topk_group": 1, "group_score": "top2", "logit_softcap": 0.0,
            "bias_on": "scores", "bias": options["bias"]}
    if "routed_scaling_factor" not in options:
        raise NotConvertible(f"the block scales its {router} routing by {factor}, which that router cannot state")
    return router, {**options, "routed_scaling_factor": options["routed_scaling_factor"] * factor}


def _routing_twin(block, router_name, experts=None, identity=None):
    """A float32 copy of the block with only its router real: experts record (or ``experts``), the child named
    ``identity`` passes its input on, other parts return zeros."""
    children = dict(block.named_children())
    try:
        for name, child in children.items():
            if name == identity:
                setattr(block, name, nn.Identity())
            elif name != router_name and not isinstance(child, nn.Identity):
                setattr(block, name, (experts or _Capture()) if name == "experts" else _Zero())
        twin = copy.deepcopy(block)
    finally:
        for name, child in children.items():
            setattr(block, name, child)
    if any(t.is_meta for t in itertools.chain(twin.parameters(), twin.buffers())):
        twin = twin.to_empty(device="cpu")
    return twin.float().eval()


def _load_router(router, values, gate_name, roles):
    with torch.no_grad():
        router.weight.copy_(values[gate_name])
        for name, role in roles.items():
            target = router.bias if role == "logit" else router.e_score_correction_bias
            target.copy_(values[name].reshape(-1))


def _same_routing(indices, weights, routing) -> bool:
    if routing.indices.shape != indices.shape:
        return False
    a, b = indices.sort(-1), routing.indices.sort(-1)
    if not torch.equal(a.values, b.values):
        return False
    return torch.allclose(weights.gather(1, a.indices), routing.weights.float().gather(1, b.indices),
                          rtol=1e-4, atol=1e-6)


def _simplest(options: dict):
    """The zoo router with the fewest options that states this rule."""
    plain = options["n_group"] == 1 and options["logit_softcap"] == 0 and options["bias_on"] == "scores"
    unscaled = options["routed_scaling_factor"] == 1
    if plain and options["score"] == "softmax" and not options["selection_bias"] and unscaled:
        return "topk-softmax", {"bias": options["bias"], "norm_topk_prob": options["norm_topk_prob"]}
    if (options["score"] == "sigmoid" and options["selection_bias"] and options["logit_softcap"] == 0
            and options["group_score"] == "top2" and options["bias_on"] == "scores"):
        return "sigmoid-bias", {"bias": options["bias"], "n_group": options["n_group"],
                                "topk_group": options["topk_group"], "norm_topk_prob": options["norm_topk_prob"],
                                "routed_scaling_factor": options["routed_scaling_factor"]}
    return "scored-topk", options


# ---- weights ---------------------------------------------------------------------------------------------------
def block_to_zoo(sd: dict, spec: dict) -> dict:
    """One native block's state dict in the zoo block's names and layouts (``spec`` from ``block_spec``)."""
    out = {}
    for key, value in sd.items():
        if key in spec.get("splits", {}):  # one native tensor, two zoo ones (a fused gate/up projection)
            first, second = spec["splits"][key]
            out[first], out[second] = (t.contiguous() for t in value.chunk(2, dim=0))
            continue
        new = spec["renames"][key]
        if key in spec["shapes"]:
            value = value.reshape(-1)
        if spec["transposed"] and new in ("experts.gate_up_proj", "experts.down_proj"):
            value = value.transpose(1, 2).contiguous()
        out[new] = value
    return out


def block_to_native(sd: dict, spec: dict) -> dict:
    """The inverse of ``block_to_zoo``: a zoo block's state dict in the native block's names and layouts."""
    back = {v: k for k, v in spec["renames"].items()}
    out = {}
    for native, (first, second) in spec.get("splits", {}).items():
        out[native] = torch.cat([sd[first], sd[second]], dim=0)
    sd = {k: v for k, v in sd.items() if not any(k in pair for pair in spec.get("splits", {}).values())}
    for key, value in sd.items():
        native = back.get(key)
        if native is None:
            raise NotExportable(f"{key} has no place in the native block")
        if native in spec["shapes"]:
            value = value.reshape(spec["shapes"][native])
        if spec["transposed"] and key in ("experts.gate_up_proj", "experts.down_proj"):
            value = value.transpose(1, 2).contiguous()
        out[native] = value
    return out
