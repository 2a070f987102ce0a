"""zoo.apply: run any component by name on a model, validating first and recording the step."""
from __future__ import annotations

import hashlib
import inspect
import json

from zoo.components.registry import Registered, registry
from zoo.moe.layout import moe_layers, sync_layout
from zoo.moe import context as routing_context
from zoo.components.options import accepted_options, check_options, required_options

APPLICABLE = ("router", "compressor", "adapter")


class UnknownComponent(KeyError, ValueError):
    def __str__(self):
        return self.args[0]


def list_components(kind: str | None = None) -> list[dict]:
    """Registered components (or those of one kind) with their metadata and the plugin each came from.

    Model entries are listed by ``zoo.list_models``, so they are left out unless ``kind="model"``."""
    return [r.info() for r in registry.all(kind) if kind is not None or r.kind != "model"]


def find(name: str) -> Registered:
    for kind in APPLICABLE:
        if name in registry.by_kind[kind]:
            return registry.by_kind[kind][name]
    try:
        registry.get(None, name)
    except KeyError as exc:
        raise UnknownComponent(str(exc.args[0])) from None
    raise UnknownComponent(f"{name!r} is not a router, compressor or adapter and cannot be applied")


class NoChange(ValueError):
    """A step that would leave the model exactly as it is."""


def apply(model, name: str, calibration=None, check_finite: bool = True, **options):
    """Run component ``name`` on ``model`` and append the step to ``config.zoo_recipe``.

    All or nothing: options (names and types), calibration data and the model are checked first, and any
    failure, later ones included, leaves the model bit-identical and of its class. A router or compressor
    step that would change nothing is an error. A native model of a supported family is converted
    (losslessly) first. Weights must be finite before and after (``check_finite=False`` skips the scans).
    """
    from zoo.editing import calibration as calib
    from zoo.architectures.lookup import family_of
    from zoo.io.finite import check_finite as finite
    from zoo.editing.snapshot import Snapshot

    reg = find(name)
    cls = reg.obj
    skip = ("hidden_size", "num_experts") if reg.kind == "router" else ()
    check_options(cls, options, skip=skip)
    given = options
    if reg.kind == "router":
        options = {**options, **model_options(cls, model, options)}
    absent = [o for o in required_options(cls, skip=(*skip, "top_k")) if o not in options]
    if absent:
        raise ValueError(f"{name} needs option{'s' * (len(absent) > 1)} {', '.join(absent)}")
    top_k = options.get("top_k", 1)
    if reg.kind == "router" and (isinstance(top_k, bool) or not isinstance(top_k, int)):
        raise ValueError(f"top_k must be an integer, got {top_k!r}")
    component = cls(**options) if reg.kind in ("compressor", "adapter") else None  # checks its option values
    if not (reg.kind == "adapter" and cls.accepts_dense):
        family_of(model)  # an unsupported model is refused before anything changes
    calib.check(calibration, getattr(model.config.get_text_config(), "vocab_size", None))
    if check_finite:
        finite(model, where=f"the model given to {name}")
    snapshot = Snapshot(model)
    try:
        model = _run(model, reg.kind, cls, component, options, calibration)
        if check_finite:
            finite(model, where=f"the weights {name} produced")
    except BaseException as exc:
        snapshot.restore()
        if isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc):
            raise MemoryError(f"{name}: not enough memory for these options ({options}); the model is unchanged") \
                from None
        raise
    record_step(model, name, reg.kind, given, calibration, component)
    sync_layout(model)
    routing_context.attach(model)  # a router that reads the routing context gets it from each call
    # transformers caches torch.compile(model.__call__) on the model; a deepcopy of a compiled model carries
    # the original's, which would decode with the original's modules. A changed model compiles afresh.
    for attr in ("_compiled_call", "_last_compile_config"):
        model.__dict__.pop(attr, None)
    return model


def model_options(cls, model, options) -> dict:
    """Options a router class accepts that are facts of the model (``vocab_size``: a token-id router's table is
    the model's vocabulary): filled in from its config; a given value that differs is refused."""
    if "vocab_size" not in accepted_options(cls):
        return {}
    vocab = model.config.get_text_config().vocab_size
    if options.get("vocab_size", vocab) != vocab:
        raise ValueError(f"vocab_size={options['vocab_size']!r}, but this model's vocabulary has {vocab} tokens "
                         "(leave it out: zoo.apply fills it in)")
    return {"vocab_size": vocab}


def _run(model, kind, cls, component, options, calibration):
    """The step itself; returns the model. Router and compressor steps must change something."""
    from zoo.io.convert import convert
    from zoo.editing.snapshot import Fingerprint

    if kind == "adapter":  # an adapter that builds an MoE from a dense model gets it unconverted
        return component.attach(model if cls.accepts_dense else convert(model))
    if kind == "router" and cls.target == "attention":
        return convert(cls.attach(model, **options))  # wraps every layer's self-attention, all checked first
    model = convert(model)
    if not moe_layers(model):
        raise ValueError(f"{cls.name} changes MoE layers and this model has none")
    before = Fingerprint(model)
    if kind == "router":
        _swap_routers(model, cls, options)
    else:
        model = component.compress(model, calibration=calibration)
    if before.same_as(model):
        raise NoChange(f"{cls.name} with options {options or '{}'} changes nothing in this model")
    return model


def record_step(model, name: str, kind: str, options: dict, calibration, component=None) -> dict:
    """Append a step to ``config.zoo_recipe``: name, kind, options, the calibration data the step ran on (the
    default corpus when a component that calibrates got none: ``"default": true``), the component's results."""
    from zoo.editing.calibration import used

    ran_on = used(calibration, component)
    step = {"name": name, "kind": kind, "options": _jsonable(options), "calibration": describe(ran_on)}
    if calibration is None and ran_on is not None:
        step["calibration"]["default"] = True
    reg = registry.find(kind, name)
    step.update(reg.provenance if reg is not None else {})  # the distribution and version that provided it
    if getattr(component, "results", None):
        step["results"] = component.results
    model.config.zoo_recipe = list(model.config.zoo_recipe or []) + [step]
    return step


class RouterSwap:
    """A router replacement as a per-layer step (the streaming path; ``zoo.apply`` swaps every layer at once,
    with the same ``new_router``)."""

    kind, inputs_for, needs_plan = "router", (), False

    def __init__(self, cls, options):
        if cls.target == "attention":
            raise ValueError(f"router {cls.name!r} wraps attention: it runs on a model in memory (--no-stream)")
        check_options(cls, options, skip=("hidden_size", "num_experts"))
        given = sorted(set(options) & set(LAYER_OPTIONS))
        if given:
            raise ValueError(f"{', '.join(given)}: filled in by zoo.apply for each layer, not an option to pass")
        self.cls, self.name, self.options = cls, cls.name, dict(options)

    def check_layers(self, layers):
        self.cls.check_layers(layers, self.options)  # options that name layers must name MoE layers of the checkpoint

    def check_layer(self, index, block):
        pass

    def compress_layer(self, index, block, inputs):
        router = new_router(index, block, self.cls, self.options)
        return block.with_parts(router=router)


# Options a router class may accept that zoo.apply fills in per layer (recorded in the layout like any other):
# the layer's index, and the selection rule it replaces (a router that wraps another one records it as `base`).
LAYER_OPTIONS = {"layer": lambda i, old: i, "base": lambda i, old: old.options.get("base", old.name)}


def _swap_routers(model, cls, options):
    """Build every new router first (any error leaves the model as it was), then swap them in.

    Options the old router had and the new class accepts carry over (so ``top_k=1`` keeps
    ``norm_topk_prob``), and so do gate weights of matching name and shape.
    """
    from zoo.io.convert import hook_new_routers

    given = sorted(set(options) & set(LAYER_OPTIONS))
    if given:
        raise ValueError(f"{', '.join(given)}: filled in by zoo.apply for each layer, not an option to pass")
    cls.check_layers([i for i, _ in moe_layers(model)], options)
    new = [(moe, new_router(i, moe, cls, options)) for i, moe in moe_layers(model)]
    for moe, router in new:
        moe.router = router
    hook_new_routers(model, [r for _, r in new])


def new_router(i, moe, cls, options):
    """Layer i's router of class ``cls``: options the old router had and the new class accepts carry over (so
    ``top_k=1`` keeps ``norm_topk_prob``), and so do gate weights of matching name and shape (the experts' rows of
    the gate where one router also scores shared experts). A router that weighs S shared experts needs S of them."""
    import torch

    from zoo.moe.block import check_shared_rows
    from zoo.moe.surgery import place_like

    accepted = set(accepted_options(cls, skip=("hidden_size", "num_experts", "top_k")))
    old = moe.router
    opts = {k: v for k, v in old.options.items() if k in accepted}
    opts.update({k: v for k, v in options.items() if k != "top_k"})
    opts.update({k: fill(i, old) for k, fill in LAYER_OPTIONS.items() if k in accepted})
    router = cls(old.hidden_size, old.num_experts, options.get("top_k", _default_k(cls, old.top_k)), **opts)
    check_shared_rows(router, moe.shared_experts)
    mine, theirs = router.state_dict(), old.state_dict()
    carried = {k: v for k, v in theirs.items() if k in mine and mine[k].shape == v.shape}
    if old.shared_rows != router.shared_rows:  # rows scoring shared experts (inkling-topk's) differ in number:
        for k in ("weight", "bias"):  # the experts' rows, before them, carry over
            if k in mine and torch.is_tensor(theirs.get(k)) and theirs[k].shape[1:] == mine[k].shape[1:]:
                carried[k] = torch.cat([theirs[k][:old.num_experts], mine[k][old.num_experts:]])
    router.load_state_dict(carried, strict=False)
    return place_like(router, old)


def _default_k(cls, current: int) -> int:
    """Keep the layer's k, unless the router class fixes its own default (e.g. a top-1 router)."""
    default = inspect.signature(cls.__init__).parameters.get("top_k")
    return current if default is None or default.default is inspect.Parameter.empty else default.default


def describe(calibration):
    """A JSON-able record of calibration data: what it was (a corpus spec: its source, domain, tokens, seq_len,
    seed and the tokens it gives), how much, and a checksum."""
    from zoo.editing import calibration as calib

    if calibration is None:
        return None
    if isinstance(calibration, dict):
        try:
            spec = calib.corpus(**calibration)
        except (TypeError, ValueError):
            return {"type": "corpus", **calibration}
        return {"type": "corpus", "source": calib.SOURCE, **spec, "tokens_used": calib.tokens_used(spec)}
    if isinstance(calibration, str):
        calibration = [calibration]
    try:
        items = list(calibration)
    except TypeError:
        return {"type": type(calibration).__name__}
    digest = hashlib.sha256()
    for item in items:
        digest.update(item.encode() if isinstance(item, str) else repr(getattr(item, "shape", item)).encode())
    kind = "texts" if all(isinstance(i, str) for i in items) else "batches"
    record = {"type": kind, "count": len(items), "sha256": digest.hexdigest()[:16]}
    if kind == "batches" and all(hasattr(i, "numel") for i in items):
        record["tokens"] = sum(int(i.numel()) for i in items)
    return record


def _jsonable(options: dict) -> dict:
    try:
        json.dumps(options)
        return dict(options)
    except TypeError:
        return {k: v if isinstance(v, (int, float, str, bool, type(None), list, dict)) else repr(v)
                for k, v in options.items()}
