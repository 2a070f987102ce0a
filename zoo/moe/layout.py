"""Per-layer structure of a zoo model (``config.zoo_layout``): read it off a model, rebuild blocks from it."""
from __future__ import annotations

from torch import nn

from zoo.moe import SharedMLP, SparseMoE
from zoo.moe.block_parts import PARTS, PartsMismatch, part_problems
from zoo.components.registry import registry


def family_and_base(model, family=None):
    """(family spec or None, base model) of a zoo or native model, or of its base model (through a PEFT
    wrapper: its base model still runs the adapter's layers)."""
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        model = model.get_base_model()
    fam = family or getattr(type(model), "zoo_family", None)
    base = getattr(model, getattr(fam, "base_attr", None) or "model", model)  # DBRX's sits at .transformer
    if not isinstance(base, nn.Module):
        base = model
    fam = fam or getattr(type(base), "zoo_family", None)
    return fam, base


def decoder_layers(model, family=None):
    """The decoder layers (``model.layers`` for text families; the language model's for vision-language ones; the
    layers holding the MoE blocks of both stacks, encoder first, for an encoder-decoder family)."""
    fam, base = family_and_base(model, family)
    paths = _layer_paths(fam, base)
    if paths is not None:
        return [base.get_submodule(path) for path in paths]
    return base.get_submodule(getattr(fam, "layers_path", None) or "layers")


def _layer_paths(fam, base) -> list[str] | None:
    """The family's own list of where its MoE layers sit below ``base`` (``Family.layer_paths``), or None."""
    own = getattr(fam, "layer_paths", None)
    return own(base) if callable(own) else None


def block_attr(model, family=None) -> str:
    """The decoder-layer attribute that holds the MoE block (``mlp``, ``feed_forward``, ``block_sparse_moe``...)."""
    fam, _ = family_and_base(model, family)
    return getattr(fam, "block_attr", None) or "mlp"


def set_block(model, i: int, block, family=None) -> None:
    setattr(decoder_layers(model, family)[i], block_attr(model, family), block)


def replace_blocks(model, blocks: dict) -> None:
    """Put ``{layer index: SparseMoE}`` in place, in whatever family the model is (``mlp``, ``feed_forward``,
    ...). Build every new block first and call this last: a failure while building leaves the model as it was."""
    layers, attr = decoder_layers(model), block_attr(model)
    for i, block in blocks.items():
        setattr(layers[i], attr, block)


def block_prefix(model, i: int, family=None) -> str:
    """State-dict prefix of layer i's MoE block in the causal-LM (or conditional-generation) model."""
    return f"{layer_prefix(model, i, family)}{block_attr(model, family)}."


def native_block_prefix(model, i: int, family=None) -> str:
    """State-dict prefix of layer i's MoE tensors in the family's native checkpoint: the block's own, or the decoder
    layer's where the family keeps them in the layer itself (``Family.native_in_layer``, Gemma 4)."""
    fam, _ = family_and_base(model, family)
    return layer_prefix(model, i, family) if getattr(fam, "native_in_layer", False) else block_prefix(model, i, family)


def layer_prefix(model, i: int, family=None) -> str:
    """State-dict prefix of decoder layer i in the causal-LM (or conditional-generation) model."""
    fam, base = family_and_base(model, family)
    paths = _layer_paths(fam, base)
    # below the base model; where that is the top model itself (an encoder-decoder, Llama 4 multimodal): no prefix
    top = model.get_base_model() if hasattr(model, "peft_config") and hasattr(model, "get_base_model") else model
    head = "" if base is top else f"{getattr(fam, 'base_attr', None) or 'model'}."
    if paths is not None:
        return f"{head}{paths[i]}."
    return f"{head}{getattr(fam, 'layers_path', None) or 'layers'}.{i}."


BLOCK_ATTRS = ("mlp", "feed_forward", "block_sparse_moe", "mixer", "moe", "ffn")


def layer_block_attr(layer) -> str:
    """The attribute of a decoder layer that holds its MoE block (or, in a dense layer, its MLP)."""
    for attr in BLOCK_ATTRS:
        if isinstance(getattr(layer, attr, None), SparseMoE):
            return attr
    return next((a for a in BLOCK_ATTRS if hasattr(layer, a)), "mlp")


def get_block(layer):
    return getattr(layer, layer_block_attr(layer), None)


def put_block(layer, block) -> None:
    setattr(layer, layer_block_attr(layer), block)


def moe_layers(model):
    """(layer index, SparseMoE) for every converted MoE layer of a model."""
    attr = block_attr(model)
    return [(i, getattr(layer, attr)) for i, layer in enumerate(decoder_layers(model))
            if isinstance(getattr(layer, attr, None), SparseMoE)]


def read_layout(model) -> list[dict | None]:
    attr = block_attr(model)
    return [getattr(layer, attr).layout() if isinstance(getattr(layer, attr, None), SparseMoE) else None
            for layer in decoder_layers(model)]


MODULE_KINDS = ("adapter", "compressor")


def module_owner(spec: dict) -> tuple[str, str]:
    """(kind, name) of the component a ``zoo_spec()`` names (its ``adapter`` or ``compressor`` key)."""
    kind = next((k for k in MODULE_KINDS if k in spec), None)
    if kind is None:
        raise LayoutError(f"a zoo_modules entry must name its adapter or compressor, got {sorted(spec)}")
    return kind, spec[kind]


def read_modules(model) -> dict:
    """Modules an adapter or compressor put outside the MoE blocks (e.g. on attention projections): ``{path:
    spec}``. Such a module has ``zoo_spec()``, a JSON-able dict naming its ``adapter`` or ``compressor``, whose
    class rebuilds it empty with ``build_module(module_it_replaced, spec)``."""
    return {name: m.zoo_spec() for name, m in model.named_modules() if callable(getattr(m, "zoo_spec", None))}


def read_attention(model) -> list[dict | None]:
    """Per decoder layer, the ``layout()`` of a wrapped self-attention (a router with ``target = "attention"``,
    e.g. mixture-of-heads), or None where the family's own attention is unchanged."""
    return [layer.self_attn.layout() if callable(getattr(getattr(layer, "self_attn", None), "layout", None)) else None
            for layer in decoder_layers(model)]


def sync_layout(model) -> None:
    """Write the model's structure into its config (``zoo.io.config_keys``): the layout, the adapter and attention
    modules, and which distribution (and version) provides each component they name."""
    config = model.config
    config.zoo_layout = read_layout(model)
    modules = read_modules(model)
    if modules or getattr(config, "zoo_modules", None):
        config.zoo_modules = modules
    attention = read_attention(model)
    if any(attention) or getattr(config, "zoo_attention", None):
        config.zoo_attention = attention
    config.zoo_components = components_provenance(config)


def components_used(config) -> list[tuple[str, str]]:
    """(kind, name) of every component a config's structure and recipe name, each once, in order."""
    used = []
    for entry in [*(getattr(config, "zoo_layout", None) or []), getattr(config, "zoo_vision_moe", None)]:
        if entry:
            used += [("router", entry["router"]), ("experts", entry["experts"])]
    used += [module_owner(spec) for spec in (getattr(config, "zoo_modules", None) or {}).values()]
    used += [("router", e["router"]) for e in getattr(config, "zoo_attention", None) or [] if e]
    used += [(s["kind"], s["name"]) for s in getattr(config, "zoo_recipe", None) or []]
    return list(dict.fromkeys(used))


def components_provenance(config) -> dict:
    """``{"kind:name": {"distribution", "version"}}`` for the components a config names; one this process
    does not have keeps what the config recorded."""
    recorded = getattr(config, "zoo_components", None) or {}
    provenance = {}
    for kind, name in components_used(config):
        reg, key = registry.find(kind, name), f"{kind}:{name}"
        if reg is not None or key in recorded:
            provenance[key] = reg.provenance if reg is not None else recorded[key]
    return provenance


class MissingComponent(KeyError):
    """A model names a component no installed plugin registers; the message says which package provides it."""

    def __str__(self):
        return self.args[0]


def component_class(kind: str, name: str, provided_by: dict | None = None):
    """The registered class of a component a model names, or ``MissingComponent`` saying what to install."""
    reg = registry.find(kind, name)
    if reg is not None:
        return reg.obj
    source = (provided_by or {}).get(f"{kind}:{name}")
    if source:
        dist = source["distribution"]
        raise MissingComponent(f"this model needs the {kind} {name!r} from {dist} {source.get('version', '')}, which "
                               f"is not installed: pip install {dist} (or moe-zoo install {dist})")
    registry.get(kind, name)  # raises with close matches


def build_block(entry: dict, provided_by: dict | None = None) -> SparseMoE:
    """An empty (randomly initialised) SparseMoE with the structure an entry describes (``provided_by``: the
    config's ``zoo_components``, to name the package of a component that is not installed)."""
    router_cls = component_class("router", entry["router"], provided_by)
    experts_cls = component_class("experts", entry["experts"], provided_by)
    experts = experts_cls(**entry["experts_options"])
    router = router_cls(block_width(entry, experts), router_rows(entry), entry["num_experts_per_tok"],
                        **entry["router_options"])
    shared = SharedMLP(**entry["shared_experts"]) if entry.get("shared_experts") else None
    parts = {name: cls(**entry[name]) for name, cls in PARTS.items() if entry.get(name)}
    return SparseMoE(router, experts, shared, returns_router_scores=entry.get("returns_router_scores", False),
                     weights_scale_input=entry.get("weights_scale_input", False), expert_map=entry.get("expert_map"),
                     identity_experts=entry.get("identity_experts", 0),
                     carries_router_state=entry.get("carries_router_state", False), **parts)


def block_width(entry: dict, experts) -> int:
    """The width of the block's input, which the router reads: the experts' own unless an input projection
    leads to them (a latent block)."""
    proj = entry.get("input_proj")
    return proj["in_features"] if isinstance(proj, dict) and "in_features" in proj else experts.hidden_size


def router_rows(entry: dict) -> int:
    """The router's rows in a layout entry: one per original expert behind an expert map (hc-smoe's merged experts),
    else one per expert plus one per identity expert."""
    expert_map = entry.get("expert_map")
    return len(expert_map) if expert_map else entry["num_experts"] + entry.get("identity_experts", 0)


class LayoutError(ValueError):
    """A saved ``zoo_layout`` that cannot be built; the message names ``zoo_layout[i]`` and the field."""


FIELDS = {"router": str, "experts": str, "num_experts": int, "num_experts_per_tok": int,
          "router_options": dict, "experts_options": dict}


def check_layout(layout, num_layers: int, hidden_size: int | list[int], provided_by: dict | None = None) -> None:
    """Every problem of a layout at once, before any module is built (each entry is built on the meta
    device, so a component's own checks run too). ``hidden_size``: the model's width, or each layer's (a model
    whose decoders differ in width: ``Family.layer_widths``)."""
    if layout is None:
        return
    if not isinstance(layout, list):
        raise LayoutError(f"zoo_layout must be a list (one entry per decoder layer), got {type(layout).__name__}")
    if len(layout) != num_layers:
        raise LayoutError(f"zoo_layout has {len(layout)} entries for {num_layers} decoder layers")
    widths = hidden_size if isinstance(hidden_size, list) else [hidden_size] * num_layers
    problems = [f"zoo_layout[{i}]{p}" for i, (entry, width) in enumerate(zip(layout, widths))
                for p in _entry_problems(entry, width, provided_by)]
    if problems:
        raise LayoutError("invalid zoo_layout: " + "; ".join(problems))


def _entry_problems(entry, hidden_size: int, provided_by: dict | None) -> list[str]:
    import torch

    if entry is None:
        return []
    if not isinstance(entry, dict):
        return [f": must be an object or null, got {type(entry).__name__}"]
    problems = []
    for field, kind in FIELDS.items():
        value = entry.get(field)
        if value is None:
            problems.append(f".{field}: missing")
        elif not isinstance(value, kind) or isinstance(value, bool):
            problems.append(f".{field}: must be {kind.__name__}, got {value!r}")
    for kind in ("router", "experts"):
        name = entry.get(kind)
        if isinstance(name, str):
            try:
                component_class(kind, name, provided_by)
            except KeyError as exc:
                problems.append(f".{kind}: {exc.args[0]} (is the plugin that provides it installed?)"
                                if not isinstance(exc, MissingComponent) else f".{kind}: {exc}")
    expert_map = entry.get("expert_map")
    if expert_map is not None and not problems:
        from zoo.moe.block import check_expert_map

        try:
            if not isinstance(expert_map, list):
                raise ValueError(f"must be a list of integers, got {expert_map!r}")
            check_expert_map(expert_map, len(expert_map), entry["num_experts"])
        except ValueError as exc:
            problems.append(f".expert_map: {exc}")
    identity = entry.get("identity_experts", 0)
    if not problems:
        from zoo.moe.block import check_identity_experts

        try:
            check_identity_experts(identity, expert_map)
        except ValueError as exc:
            problems.append(f".identity_experts: {exc}")
    if not problems and not 1 <= entry["num_experts_per_tok"] <= router_rows(entry):
        what = "router rows" if expert_map else "num_experts + identity_experts" if identity else "num_experts"
        problems.append(f".num_experts_per_tok: must be in [1, {what}={router_rows(entry)}], got "
                        f"{entry['num_experts_per_tok']}")
    if problems:
        return problems
    with torch.device("meta"):
        try:
            block = build_block(entry)
        except PartsMismatch as exc:  # parts that do not fit the router's or experts' width
            return [f".{p}" for p in exc.problems]
        except Exception as exc:  # name the part that refused, with its own reason
            return [f".{_failing_part(entry)}: {exc}"]
    problems += [f".{p}" for p in part_problems(block.parts(), hidden_size, block.experts.hidden_size)]
    if entry["num_experts"] != block.experts.num_experts:
        problems.append(f".num_experts: {entry['num_experts']}, but experts_options build {block.experts.num_experts}")
    return problems


def _failing_part(entry) -> str:
    """Which field of a layout entry a failed build comes from (built again part by part, on meta)."""
    try:
        experts = component_class("experts", entry["experts"])(**entry["experts_options"])
    except Exception:
        return "experts_options"
    for name, cls in PARTS.items():
        try:
            if entry.get(name):
                cls(**entry[name])
        except Exception:
            return name
    try:
        component_class("router", entry["router"])(block_width(entry, experts), router_rows(entry),
                                                    entry["num_experts_per_tok"], **entry["router_options"])
    except Exception:
        return "router_options"
    return "shared_experts" if entry.get("shared_experts") else "num_experts"


def apply_layout(model, layout) -> None:
    layers, attr = decoder_layers(model), block_attr(model)
    provided_by = getattr(model.config, "zoo_components", None)
    fam, _ = family_and_base(model)
    widths = getattr(fam, "layer_widths", lambda config: None)(model.config)
    check_layout(layout, len(layers), widths or model.config.get_text_config().hidden_size, provided_by)
    for i, entry in enumerate(layout or []):
        if entry:
            setattr(layers[i], attr, build_block(entry, provided_by))


def apply_modules(model, modules) -> None:
    """Rebuild (empty) the modules ``read_modules`` recorded, in place of the modules they wrapped or replaced."""
    for path, spec in (modules or {}).items():
        parent, _, leaf = path.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        cls = component_class(*module_owner(spec), getattr(model.config, "zoo_components", None))
        setattr(owner, leaf, cls.build_module(getattr(owner, leaf), spec))


def apply_attention(model, entries) -> None:
    """Rebuild (empty) the wrapped self-attention ``read_attention`` recorded: ``attach(model, layers=[i], **options)``
    of the router class each entry names."""
    for i, entry in enumerate(entries or []):
        if entry:
            component_class("router", entry["router"], getattr(model.config, "zoo_components", None)).attach(model, layers=[i], **entry["options"])
