"""zoo.testing: check a component end to end, the way a user meets it.

``check_component(name, **options)`` runs a registered component (router, compressor, adapter, experts kind or
architecture) on small seeded fp32 models of several families and checks, raising ``AssertionError`` with a
one-paragraph message at the first failure:

1. bad options (a misspelt name; a wrongly typed value where an option is annotated ``int``, ``float``, ``bool`` or
   ``str``) raise, and leave the model bit-identical (every tensor, its class and its config);
2. ``zoo.apply(model, name, **options)`` works and the recipe step records the name and the options as given;
3. ``save_pretrained``, then a load in a fresh Python process (``import zoo`` and the model's Auto class) gives the
   same logits on fixed inputs, and the same output of every module on the way (the first one that differs names
   the culprit), the same layout and the same recipe;
4. ``zoo.card(model)`` (and the saved README.md) holds the section the component's card template renders;
5. every router or experts module the step put in the model that declares a ``reference`` (a plain, obviously
   correct version of ``forward`` with the same signature) matches it, outputs and gradients, on random inputs.

A family that refuses the component (``TypeError`` or ``ValueError`` before anything changed, e.g. a dense-only
adapter on an MoE model) is skipped with its reason; a component that fits none of the families fails.

What each kind means here:
- routers, compressors, adapters: applied by name with ``options``, as above. Compressors that need calibration get
  a small batch of random token ids (``calibration=`` gives other data; ``None`` lets the component draw its own).
  After the step, the tensors it added that hold one constant (a LoRA's zero B, a zero router) get seeded noise,
  as training would, so that a load that drops or re-initialises them shows;
- experts kinds (made by compressors, never applied by name): in every MoE block of each family the experts are
  replaced by the kind, built with ``cls.from_dense(old_experts, **options)`` where the class has that
  classmethod (real compressed weights), else ``cls(**options)`` with the sizes the old experts' ``options()`` give
  filled in and every floating-point tensor drawn at random (seeded); then checks 1 (the constructor must refuse a
  misspelt option; types are ``zoo.apply``'s to check, and experts kinds are not applied), 3 and 5. A card lists
  the recipe's components and the routers, not experts kinds, so 4 only renders the card;
- architectures: a tiny native model of the family (built in for the families in ``TINY``; pass ``model=`` for
  others) is converted losslessly with ``zoo.convert``, then checks 3, 4 and 5.

A name that two kinds use (``channel-topk``: a compressor and the experts it makes) means the applicable kind;
write ``experts:channel-topk`` for the other. ``model=`` checks on that model only (a copy: yours is left as it
is); ``families=`` picks built-in families (``TINY``). ``plugins=`` names modules holding ``@zoo.hookimpl
register_*`` functions that are not installed through an entry point (a plugin under development, components
defined for a test): they are registered for the check, here and in the fresh process, which gets their folder on
its ``PYTHONPATH``. ``check_components`` checks several components with one fresh process (``import zoo`` costs
seconds); an option named ``model``, ``families``, ``plugins`` or ``calibration`` goes through it too.

    from zoo.testing import check_component
    check_component("my-router", plugins=["my_plugin"], temperature=0.5)     # a plugin not installed yet
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

# Reload tolerance, relative to the largest |value| of each output compared (every module's, in the order they ran,
# then the logits). The fresh process runs the same fp32 kernels on the same weights and inputs with the same thread
# count, so outputs mostly come back bit-identical; but a loaded tensor's memory alignment can pick another kernel
# path, which changes a linear layer's output in the last bit, and the layers after it carry that on: at most
# 8.6e-7 of an output's largest value over every first-party check (replora on the tiny Qwen2-MoE). Reload bugs
# change a tensor by a bf16 rounding (2^-9) or far more; the mildest, an fp32 buffer cast to bf16 on load
# (tests/checker_toys.py), moved the router's output by 9.2e-4 of its largest value. 2e-5 sits between the two,
# 23x above the one and 46x below the other.
RELOAD_TOLERANCE = 2e-5
# Conversion (native -> zoo) computes the same function with other kernels (fused experts, another summation order).
CONVERT_TOLERANCE = 1e-5
# Fast path vs reference: the same arithmetic in another order (sorted dispatch vs one pair at a time).
REFERENCE_TOLERANCE = 1e-5
AUTO = {"causal-lm": "AutoModelForCausalLM", "image-text-to-text": "AutoModelForImageTextToText"}
FAMILIES = ("mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss", "mistral", "zoo_mm")  # what a component is checked on


# ---- tiny models ------------------------------------------------------------------------------------------------

def _common(**extra) -> dict:
    return dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)


# family -> (config class name in transformers, its keyword arguments): 20-80 thousand parameters each. Widths are
# 32, the smallest quantization group; Qwen2-MoE and DeepSeek-V3 have a dense layer next to MoE ones and shared
# experts, GPT-OSS biased experts and a clamped activation.
TINY = {
    "mixtral": ("MixtralConfig", _common(intermediate_size=32, num_hidden_layers=2, num_local_experts=4,
                                         num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", _common(intermediate_size=64, moe_intermediate_size=32,
                                            shared_expert_intermediate_size=32, num_hidden_layers=3, num_experts=6,
                                            num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1])),
    "qwen3_moe": ("Qwen3MoeConfig", _common(intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", _common(intermediate_size=32, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)),
    "deepseek_v3": ("DeepseekV3Config", dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, rope_interleave=True)),
    "gpt_oss": ("GptOssConfig", _common(intermediate_size=32, num_hidden_layers=2, num_local_experts=4,
                                        num_experts_per_tok=2, sliding_window=16,
                                        layer_types=["sliding_attention", "full_attention"])),
    "mistral": ("MistralConfig", _common(intermediate_size=64, num_hidden_layers=2)),  # dense
    "zoo_mm": ("ZooMMConfig", dict(vocab_size=25, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   moe_intermediate_size=32, group_sizes=[2, 3, 3], top_groups=2,
                                   num_experts_per_tok=2, vision_experts=3)),
}


def tiny_model(family: str, seed: int = 0):
    """A seeded fp32 model of a built-in family (``TINY``), in eval mode: native for transformers' families, the
    zoo's own for ``zoo_mm``. Router weights and biases get real spread (some families start them at zero, which
    would make routing ties and hide mistakes)."""
    import transformers

    if family not in TINY:
        raise KeyError(f"no built-in tiny model of {family!r}; built in: {', '.join(TINY)}")
    config_name, kwargs = TINY[family]
    torch.manual_seed(seed)
    if family == "zoo_mm":
        from zoo_multimodal.configuration_zoo_mm import ZooMMConfig
        from zoo_multimodal.modeling_zoo_mm import ZooMMForCausalLM

        return ZooMMForCausalLM(ZooMMConfig(**kwargs)).eval()
    config = getattr(transformers, config_name)(**copy.deepcopy(kwargs))
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name or "sinks" in name or (("gate" in name or "router" in name) and "proj" not in name):
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0, 0.1)
    return model


def sample_inputs(model, seed: int = 0) -> dict:
    """Fixed inputs for ``model``: 2 rows of 8 token ids (no special token), plus image patches and audio frames
    for ``zoo_mm``."""
    config = model.config
    text = config.get_text_config()
    special = {v for c in (config, text) for k, v in c.to_dict().items()
               if isinstance(v, int) and not isinstance(v, bool) and ("token_id" in k or "token_index" in k)}
    allowed = torch.tensor([i for i in range(3, min(text.vocab_size, 100)) if i not in special])
    g = torch.Generator().manual_seed(seed)
    inputs = {"input_ids": allowed[torch.randint(len(allowed), (2, 8), generator=g)]}
    if config.model_type == "zoo_mm":
        patches = (config.image_size // config.patch_size) ** 2
        inputs["pixel_values"] = torch.randn(2, patches, config.patch_size ** 2, generator=g)
        inputs["audio_features"] = torch.randn(2, config.audio_frames, config.num_mel_bins, generator=g)
    return inputs


def calibration_for(model, seed: int = 0) -> list:
    """Small calibration data for ``model``: one batch of 4 x 16 random token ids inside its vocabulary."""
    vocab = model.config.get_text_config().vocab_size
    return [torch.randint(3, vocab, (4, 16), generator=torch.Generator().manual_seed(seed))]


# ---- plugins that are not installed -----------------------------------------------------------------------------

def register_plugin(module) -> list:
    """Register the components of a plugin module (``@zoo.hookimpl register_*`` functions) that is not installed
    through an entry point; returns the new registry entries (``unregister`` takes them out again). Components
    already registered from this module are left as they are."""
    from zoo.registry import KINDS, Registered, registry

    module = importlib.import_module(module) if isinstance(module, str) else module
    entries = []
    for hook, kind in KINDS.items():
        fn = getattr(module, hook, None)
        if callable(fn):
            fn(register=lambda obj, kind=kind: entries.append(
                Registered(kind, obj.name, obj, module.__name__, module.__name__.split(".")[0],
                           str(getattr(module, "__version__", "0+local")))))
    entries = [e for e in entries if getattr(registry.find(e.kind, e.name), "obj", None) is not e.obj]
    registry.add_all(entries)
    for e in entries:
        if e.kind == "architecture":
            e.obj.register_auto_classes()
    return entries


def unregister(entries) -> None:
    from zoo.registry import registry

    for e in entries:
        registry.by_kind[e.kind].pop(e.name, None)


def _module_root(name: str) -> str:
    """The sys.path folder from which module ``name`` is imported."""
    module = importlib.import_module(name)
    root = Path(module.__file__).resolve().parent
    if Path(module.__file__).name == "__init__.py":
        root = root.parent
    for _ in range(name.count(".")):
        root = root.parent
    return str(root)


# ---- the checks -------------------------------------------------------------------------------------------------

def check_component(name: str, model=None, *, families=None, plugins=(), calibration="auto", **options) -> dict:
    """Check component ``name`` (``kind:name`` where a name is taken by two kinds) with ``options`` end to end (see
    the module docstring); raises ``AssertionError`` at the first failure, else returns a report:
    ``{"name", "kind", "families": [checked], "skipped": {family: reason}, "max_logit_diff": float,
    "references": [classes compared with their reference]}``."""
    return check_components([(name, options, model)], families=families, plugins=plugins,
                            calibration=calibration)[0]


def check_components(checks, *, families=None, plugins=(), calibration="auto", strict=True) -> list[dict]:
    """Check several components with one fresh process for all reloads. Each check is ``(name, options)``,
    ``(name, options, model)`` or a dict with ``name`` and any of ``options``, ``model``, ``families``,
    ``calibration`` (which override the arguments here). Returns one report per check, in order. ``strict``
    (default) raises ``AssertionError`` at the first failure; ``strict=False`` puts it in that report's
    ``"failure"`` instead and checks everything else."""
    from zoo.plugins import load_plugins

    load_plugins()
    added = [e for m in plugins for e in register_plugin(m)]
    try:
        with tempfile.TemporaryDirectory(prefix="zoo-check-") as tmp:
            reports, cases = [], []
            for n, item in enumerate(checks):
                if not isinstance(item, dict):
                    item = dict(zip(("name", "options", "model"), item))
                item = {"options": {}, "model": None, "families": families, "calibration": calibration, **item}
                report = {"name": item["name"], "kind": None, "families": [], "skipped": {}, "max_logit_diff": 0.0,
                          "references": []}
                reports.append(report)
                try:
                    cases += _prepare(report, item["model"], item["options"], item["families"], item["calibration"],
                                      os.path.join(tmp, str(n)))
                except AssertionError as exc:
                    _fail(report, exc, strict)
            try:
                _reload(cases, plugins, tmp)
            except AssertionError as exc:  # the fresh process itself failed: every check that reached it fails
                for report in {id(c["report"]): c["report"] for c in cases}.values():
                    _fail(report, exc, strict)
            for case in cases:
                report = case["report"]
                if "failure" not in report and "reloaded" in case:
                    try:
                        _compare(case)
                    except AssertionError as exc:
                        _fail(report, exc, strict)
            return reports
    finally:
        unregister(added)


def _fail(report, exc, strict):
    if strict:
        raise exc
    report["failure"] = str(exc)


def _prepare(report, model, options, families, calibration, folder) -> list[dict]:
    """Everything in this process for one check; returns the cases (one per model) to reload."""
    name = report["name"]
    reg = _lookup(name)
    kind = report["kind"] = reg.kind
    if kind == "model":
        raise AssertionError(f"{name!r} is a registry model entry, not a component: nothing to check")
    if model is not None:
        targets = [(_label(model), lambda: copy.deepcopy(model))]
    else:
        names = families or ((reg.name,) if kind == "architecture" else FAMILIES)
        if kind == "architecture" and reg.name not in TINY:
            raise AssertionError(f"architecture {reg.name!r} has no built-in tiny model (built in: {', '.join(TINY)}): "
                                 f"pass model=, a small native model of the family")
        targets = [(f, lambda f=f: tiny_model(f)) for f in names]
    cases = []
    for label, build in targets:
        where = f"{name} on {label}"
        with _failing_as(where, "building or applying it (a refusal must be a TypeError or ValueError)"):
            if kind == "architecture":
                case = _architecture_case(reg.obj, build(), where)
            elif kind == "experts":
                case = _experts_case(reg.obj, build(), options, where)
            else:
                case = _applied_case(reg, build(), options, calibration, where)
        if isinstance(case, str):
            report["skipped"][label] = case if len(case) <= 200 else case[:197] + "..."
            continue
        report["families"].append(label)
        case.update(report=report, where=where, folder=os.path.join(folder, label))
        with _failing_as(where, "running and saving it"):
            _save(case)
        with _failing_as(where, "rendering its card"):
            _check_card(case, reg.obj, kind)
        with _failing_as(where, "comparing a module with its reference"):
            report["references"] = sorted(set(report["references"]) | set(_check_references(case, where)))
        cases.append(case)
    if not cases:
        why = "; ".join(f"{f}: {r}" for f, r in report["skipped"].items())
        raise AssertionError(f"{name} fits none of the models it was checked on ({why}). A component must work on "
                             "at least one; pass model= (or families=) to check it on one it is made for.")
    return cases


@contextlib.contextmanager
def _failing_as(where: str, step: str):
    """Any exception of the component inside is a failed check: an AssertionError naming where and what ran."""
    try:
        yield
    except AssertionError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise AssertionError(f"{where}: {step} raised {type(exc).__name__}: {exc}") from exc


def _lookup(name: str):
    """The registered component ``name`` (``kind:name`` picks a kind; by default the applicable kinds come first,
    as for ``zoo.apply``, so ``channel-topk`` is the compressor and ``experts:channel-topk`` its experts kind)."""
    from zoo.registry import registry

    kind, _, bare = name.rpartition(":")
    for k in [kind] if kind else ["router", "compressor", "adapter", "experts", "architecture", "model"]:
        if bare in registry.by_kind.get(k, {}):
            return registry.by_kind[k][bare]
    try:
        registry.get(kind or None, bare)
    except KeyError as exc:
        raise AssertionError(str(exc.args[0])) from None
    raise AssertionError(f"no {kind} component named {bare!r}")


def _label(model) -> str:
    from zoo.layout import family_and_base

    fam, _ = family_and_base(model)
    return fam.name if fam is not None else model.config.model_type


def _state(model):
    """What must not change: the class, the structure, the config and every tensor's bytes (buffers that are not
    saved included)."""
    from zoo.snapshot import Fingerprint

    return (type(model), Fingerprint(model), json.dumps(model.config.to_dict(), sort_keys=True, default=repr),
            {n: _bytes(t) for n, t in _tensors(model)})


def _tensors(model):
    return [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]


def _bytes(t: torch.Tensor) -> tuple:
    return t.dtype, tuple(t.shape), t.detach().reshape(-1).view(torch.uint8).clone()


def _unchanged(model, before, what: str, where: str) -> None:
    cls, fingerprint, config, tensors = before
    now = {n: _bytes(t) for n, t in _tensors(model)}
    same_bytes = now.keys() == tensors.keys() and all(
        a[:2] == b[:2] and torch.equal(a[2], b[2]) for a, b in ((now[n], tensors[n]) for n in now))
    checks = {"its class": type(model) is cls, "its structure": fingerprint.same_as(model),
              "its tensors": same_bytes,
              "its config": json.dumps(model.config.to_dict(), sort_keys=True, default=repr) == config}
    changed = [part for part, same in checks.items() if not same]
    if changed:
        raise AssertionError(f"{where}: {what} raised but changed the model ({', '.join(changed)}). A step must "
                             "validate everything before it touches the model, or put it back exactly as it was.")


def _misspelt(key: str, accepted) -> str:
    wrong = key[:-3] + key[-2] + key[-3] + key[-1] if len(key) > 3 else key + "x"
    return wrong if wrong not in accepted and wrong != key else key + "_x"


WRONG = {int: "2", float: "0.5", bool: "yes", str: 3}


def bad_options(cls, options: dict, skip=()) -> list[tuple[str, dict]]:
    """``[(what, options)]``: ``options`` with one name misspelt (or an unknown one added), and, where the class
    annotates an option ``int``, ``float``, ``bool`` or ``str``, one value of another type."""
    from zoo.options import accepted_options, annotated_types

    accepted = accepted_options(cls, skip=skip)
    key = next(iter(options), accepted[0] if accepted else "option")
    wrong = _misspelt(key, accepted)
    rest = {k: v for k, v in options.items() if k != key}
    out = [(f"the misspelt option {wrong!r}", {**rest, wrong: options.get(key, 1)})]
    types = {k: t for k, t in annotated_types(cls).items() if k in accepted}
    typed = [k for k in options if k in types] + [k for k in types if k not in options]
    if typed:
        value = WRONG[types[typed[0]][0]]
        out.append((f"{typed[0]}={value!r} (it must be {types[typed[0]][0].__name__})",
                    {**options, typed[0]: value}))
    return out


def _applied_case(reg, model, options, calibration, where):
    import zoo

    cls, kind = reg.obj, reg.kind
    if calibration == "auto":
        calibration = calibration_for(model) if kind == "compressor" and _needs_calibration(cls, options) else None
    before = _state(model)
    skip = ("hidden_size", "num_experts") if kind == "router" else ()
    for what, bad in bad_options(cls, options, skip):
        try:
            zoo.apply(model, reg.name, calibration=calibration, **bad)
        except (TypeError, ValueError):
            pass
        else:
            raise AssertionError(f"{where}: zoo.apply accepted {what}. Options must be checked by name and type "
                                 "before anything runs (name each option in __init__ and annotate its type).")
        _unchanged(model, before, f"zoo.apply with {what}", where)
    base = copy.deepcopy(model)  # converted as zoo.apply will convert it: what the step starts from
    try:
        base = zoo.convert(base)
    except (TypeError, ValueError):
        pass  # a model the zoo does not convert (a dense one to upcycle)
    classes, shapes = _part_classes(base), _shapes(base)
    try:
        model = zoo.apply(model, reg.name, calibration=calibration, **options)
    except (TypeError, ValueError) as exc:
        _unchanged(model, before, f"zoo.apply refusing it ({exc})", where)
        return f"{type(exc).__name__}: {exc}"
    step = model.config.zoo_recipe[-1]
    if step.get("name") != reg.name or step.get("options") != options:
        raise AssertionError(f"{where}: the recipe step records {step.get('name')!r} with options "
                             f"{step.get('options')!r}, not {reg.name!r} with {options!r} as given.")
    for key in ("distribution", "version"):
        if key in step and not step[key]:
            raise AssertionError(f"{where}: the recipe step's {key} is empty: {step!r}")
    _as_if_trained(model, shapes)
    case = {"model": model, "new": [c for c in _part_classes(_unwrapped(model)) if c not in classes] + [cls]}
    if _is_peft(model):
        case["base"] = base  # a PEFT result saves only its adapter
    return case


def _unwrapped(model):
    """The zoo model inside a PEFT model (or the model itself)."""
    return model.get_base_model() if _is_peft(model) else model


def _shapes(model) -> dict[str, tuple]:
    """Tensor name -> shape, with PEFT's ``base_layer`` wrappers left out of the names."""
    return {n.replace(".base_layer", ""): tuple(t.shape) for n, t in _unwrapped(model).state_dict().items()}


def _as_if_trained(model, before: dict[str, tuple], seed: int = 0) -> None:
    """Seeded noise on the tensors the step added (names or shapes the model did not have) that hold one constant
    (a LoRA's zero B, a zero router, a zero bias): training would move them, and a load that re-initialises or drops
    them must show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, t in _unwrapped(model).state_dict().items():
            if t.is_floating_point() and t.numel() > 1 and before.get(n.replace(".base_layer", "")) != tuple(t.shape) \
                    and bool((t == t.flatten()[0]).all()):
                t.add_(torch.randn(t.shape, generator=g).to(t.dtype) * 0.02)


def _needs_calibration(cls, options) -> bool:
    if getattr(cls, "needs_calibration", False):
        return True
    try:  # some compressors decide it from their options (quantize with allocation="pmq")
        return bool(getattr(cls(**options), "needs_calibration", False))
    except Exception:  # noqa: BLE001 - zoo.apply reports bad options itself
        return False


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def build_experts(cls, block, options: dict, seed: int = 0):
    """Experts of kind ``cls`` for ``block`` (see the module docstring)."""
    from zoo.options import accepted_options

    old = block.experts
    if hasattr(cls, "from_dense"):
        return cls.from_dense(old, **options)
    accepted = accepted_options(cls)
    sizes = {k: v for k, v in old.options().items() if k in accepted and k not in options}
    new = cls(**sizes, **options)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in [*new.parameters(), *new.buffers()]:
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g) * 0.05)
    return new.to(next((t.dtype for t in old.parameters() if t.is_floating_point()), torch.float32))


def _experts_case(cls, model, options, where):
    import zoo
    from zoo.layout import moe_layers, set_block, sync_layout
    from zoo.options import accepted_options

    try:
        model = zoo.convert(model)
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    layers = moe_layers(model)
    if not layers:
        return "no MoE layer"
    before = _state(model)
    filled = [k for k in layers[0][1].experts.options() if k in accepted_options(cls) and k not in options]
    for what, bad in bad_options(cls, options, skip=filled)[:1]:  # types: zoo.apply's check, not the constructor's
        try:
            build_experts(cls, layers[0][1], bad)
        except (TypeError, ValueError):
            pass
        else:
            raise AssertionError(f"{where}: building {cls.name} experts accepted {what}. Validate every option "
                                 "in __init__.")
        _unchanged(model, before, f"building with {what}", where)
    try:
        blocks = [(i, moe.with_parts(experts=build_experts(cls, moe, options, seed=i))) for i, moe in layers]
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    for i, block in blocks:
        set_block(model, i, block)
    sync_layout(model)
    return {"model": model, "new": [cls]}


def _architecture_case(fam, model, where):
    import zoo

    if not fam.matches(model):
        raise AssertionError(f"{where}: the model given ({type(model).__name__}) is no {fam.name} model.")
    inputs = sample_inputs(model)
    native = _logits(model, inputs)
    model = zoo.convert(model)
    converted = _logits(model, inputs)
    diff = _max_diff(converted, native)
    if diff > CONVERT_TOLERANCE * max(native.abs().max().item(), 1e-6):
        raise AssertionError(f"{where}: zoo.convert changed the logits by up to {diff:.3g} (largest logit "
                             f"{native.abs().max().item():.3g}); conversion must be lossless.")
    return {"model": model, "new": None}


def _part_classes(model) -> list[type]:
    from zoo.layout import moe_layers

    try:
        layers = moe_layers(model)
    except Exception:  # noqa: BLE001 - a model the zoo cannot read (a dense one) has no parts
        return []
    return list(dict.fromkeys(type(p) for _, moe in layers for p in (moe.router, moe.experts)))


def _logits(model, inputs) -> torch.Tensor:
    return _forward(model, inputs)["logits"]


def _forward(model, inputs) -> dict[str, torch.Tensor]:
    """The logits and every module's output (``name#call``, in the order they finish; the first tensor of a tuple
    such as a Routing) on ``inputs``, in eval mode."""
    outputs, calls = {}, {}

    def record(name, out):
        if isinstance(out, (tuple, list)):
            out = next((o for o in out if torch.is_tensor(o)), None)
        if torch.is_tensor(out) and out.is_floating_point():
            calls[name] = calls.get(name, -1) + 1
            outputs[f"{name}#{calls[name]}"] = out.detach().float().clone()

    hooks = [m.register_forward_hook(lambda _, __, out, name=name: record(name, out))
             for name, m in model.named_modules() if name]
    model.eval()
    try:
        with torch.no_grad():
            logits = model(**inputs, use_cache=False).logits.float()
    finally:
        for h in hooks:
            h.remove()
    return {**outputs, "logits": logits}


def _max_diff(a, b) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).detach().abs().nan_to_num(float("inf")).max()) if a.numel() else 0.0


def _save(case) -> None:
    """Save the model (and the base of a PEFT adapter) and record what the fresh process must reproduce."""
    from zoo.convert import family_of
    from zoo.layout import read_layout

    model, where = case["model"], case["where"]
    case["inputs"] = sample_inputs(model)
    logits = _logits(model, case["inputs"])
    model.save_pretrained(case["folder"])
    case["outputs"] = _forward(model, case["inputs"])
    if not torch.equal(logits, case["outputs"]["logits"]):
        raise AssertionError(f"{where}: save_pretrained changed the model's logits (by up to "
                             f"{_max_diff(case['outputs']['logits'], logits):.3g}).")
    zoo_model = _unwrapped(model)
    case["layout"] = read_layout(zoo_model)
    case["recipe"] = json.loads(json.dumps(zoo_model.config.zoo_recipe or []))
    case["class"] = type(model).__name__
    if "base" in case:
        case["base_folder"] = case["folder"] + "-base"
        case.pop("base").save_pretrained(case["base_folder"])
    auto = getattr(family_of(zoo_model), "auto", "causal-lm")
    case["auto"] = AUTO.get(auto) or f"{type(zoo_model).__module__}:{type(zoo_model).__qualname__}"


_SENTINEL = "\x00layout\x00"


def _check_card(case, component, kind) -> None:
    """The card holds every line of the component's rendered section (lines that show the layout summary aside)."""
    import zoo
    from zoo.cards import render_component_card
    from zoo.convert import family_of

    model, where = _unwrapped(case["model"]), case["where"]
    text = str(zoo.card(model))
    if not getattr(component, "card", "") or kind == "experts":
        return  # cards list the recipe's components and the routers; experts kinds appear through their step
    recipe = list(model.config.zoo_recipe or [])
    context = {"family": family_of(model).name, "layout_summary": _SENTINEL, "recipe": recipe}
    lines = [ln.strip() for ln in render_component_card(component, context).splitlines()]
    lines = [ln for ln in lines if ln and _SENTINEL not in ln]
    readme = os.path.join(case["folder"], "README.md")
    saved = Path(readme).read_text() if os.path.exists(readme) else ""
    for label, body in (("zoo.card(model)", text), ("the saved README.md", saved if "moe-zoo" in saved else None)):
        missing = [ln for ln in lines if body is not None and ln not in body]
        if missing:
            raise AssertionError(f"{where}: {label} lacks the section of {component.card}: {missing[0]!r} (and "
                                 f"{len(missing) - 1} more lines) is not in it.")


# ---- references -------------------------------------------------------------------------------------------------

def _check_references(case, where) -> list[str]:
    """Compare every part class the step added (all of them for an architecture) with its ``reference``."""
    from zoo.layout import moe_layers

    model, checked = _unwrapped(case["model"]), []
    for _, moe in moe_layers(model):
        for part in (moe.router, moe.experts):
            cls = type(part)
            if cls.__name__ in checked or getattr(cls, "reference", None) is None or \
                    (case["new"] is not None and cls not in case["new"]):
                continue
            check_reference(part, moe.top_k, where=where)
            checked.append(cls.__name__)
    return checked


def check_reference(module, top_k: int = 2, tokens: int = 12, seed: int = 0, where: str = "") -> None:
    """A router's or experts module's ``forward`` against its ``reference`` on seeded random inputs: outputs, then
    gradients (of the input, the routing weights and the parameters) of a random projection of the float outputs.
    Experts get a routing with distinct experts per token and one empty slot (index E); router outputs are
    compared slot by slot in expert order, with the weights of empty slots (ignored by contract) zeroed."""
    from zoo.moe import Router, Routing

    g = torch.Generator().manual_seed(seed)
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    hidden = torch.randn(tokens, module.hidden_size, generator=g).to(dtype).requires_grad_()
    leaves, E = [hidden], module.num_experts
    if isinstance(module, Router):
        names = ["indices", "weights", "logits"]

        def outputs(fn):
            r = fn(hidden)
            order = r.indices.argsort(dim=-1, stable=True)
            indices = r.indices.gather(-1, order)
            weights = r.weights.gather(-1, order).masked_fill(indices >= E, 0)
            return [indices, weights] + ([r.logits] if r.logits is not None else [])
    else:
        names = ["output"]
        indices = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(tokens)])
        if top_k > 1:
            indices[0, -1] = E  # an empty slot: its weight is ignored
        weights = torch.rand(tokens, top_k, generator=g).to(dtype).requires_grad_()
        leaves.append(weights)

        def outputs(fn):
            return [fn(hidden, Routing(weights=weights, indices=indices))]
    training = module.training
    module.eval()
    try:
        fast, ref = outputs(module), outputs(module.reference)
        for label, a, b in zip(names, fast, ref):
            _close(a, b, f"{where}: {type(module).__name__}.forward vs its reference, {label}")
        floats = [i for i, t in enumerate(fast) if t.is_floating_point() and t.requires_grad]
        if not floats:
            return
        directions = [torch.randn(fast[i].shape, generator=g).to(fast[i].dtype) for i in floats]
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        wrt = leaves + [p for _, p in named]
        labels = ["the input", "the routing weights"][:len(leaves)] + [f"parameter {n}" for n, _ in named]
        grads = [torch.autograd.grad(sum((out[i] * d).sum() for i, d in zip(floats, directions)), wrt,
                                     allow_unused=True) for out in (fast, ref)]
        for label, a, b in zip(labels, *grads):
            if a is None and b is None:
                continue
            a, b = (torch.zeros_like(b) if a is None else a), (torch.zeros_like(a) if b is None else b)
            _close(a, b, f"{where}: {type(module).__name__} gradient of {label} vs its reference's")
    finally:
        module.train(training)


def _close(a, b, what) -> None:
    if a.shape != b.shape:
        raise AssertionError(f"{what}: shapes {tuple(a.shape)} and {tuple(b.shape)} differ.")
    if not a.is_floating_point():
        if not torch.equal(a, b):
            raise AssertionError(f"{what}: {int((a != b).sum())} of {a.numel()} values differ.")
        return
    diff, scale = _max_diff(a.float(), b.float()), b.float().abs().max().item() if b.numel() else 0.0
    if diff > REFERENCE_TOLERANCE * max(scale, 1e-6):
        raise AssertionError(f"{what}: differ by up to {diff:.3g} (largest value {scale:.3g}).")


# ---- the fresh process ------------------------------------------------------------------------------------------

def _reload(cases, plugins, tmp) -> None:
    """Load every saved folder in one fresh process; each case gets ``"reloaded"`` (logits, class, layout, recipe)
    or ``"error"``."""
    from safetensors.torch import load_file, save_file

    if not cases:
        return
    jobs = []
    for n, case in enumerate(cases):
        inputs = os.path.join(tmp, f"inputs-{n}.safetensors")
        save_file({k: v.contiguous() for k, v in case["inputs"].items()}, inputs)
        jobs.append({"folder": case["folder"], "base_folder": case.get("base_folder"), "auto": case["auto"],
                     "inputs": inputs, "out": os.path.join(tmp, f"logits-{n}.safetensors")})
    job = os.path.join(tmp, "job.json")
    Path(job).write_text(json.dumps({"threads": torch.get_num_threads(), "plugins": list(plugins), "cases": jobs}))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    roots = [_module_root(m) for m in plugins]
    env["PYTHONPATH"] = os.pathsep.join(roots + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    script = "import sys; from zoo.testing import reload_job; reload_job(sys.argv[1])"
    run = subprocess.run([sys.executable, "-c", script, job], env=env, capture_output=True, text=True)
    results = Path(job + ".out")
    if run.returncode or not results.exists():
        raise AssertionError(f"the fresh process that reloads the saved models failed (exit {run.returncode}): "
                             f"{run.stderr.strip()[-2000:]}")
    for case, job, result in zip(cases, jobs, json.loads(results.read_text())):
        case["reloaded"] = result
        if "error" not in result:
            result["outputs"] = load_file(job["out"])


def reload_job(path: str) -> None:
    """The fresh process's side of ``check_components`` (``python -c`` runs it): load each folder of the job file
    with its Auto class (a PEFT adapter onto its saved base), write its logits on the saved inputs, and its class,
    layout and recipe next to the job file."""
    import traceback

    import transformers
    from safetensors.torch import load_file, save_file

    from zoo.layout import read_layout

    job = json.loads(Path(path).read_text())
    torch.set_num_threads(job["threads"])
    for module in job["plugins"]:
        register_plugin(module)
    out = []
    for case in job["cases"]:
        try:
            if ":" in case["auto"]:
                module, _, qualname = case["auto"].partition(":")
                cls = importlib.import_module(module)
                for part in qualname.split("."):
                    cls = getattr(cls, part)
            else:
                cls = getattr(transformers, case["auto"])
            if case["base_folder"]:  # PEFT's own load; its wrappers hide the layout, the base folder has it
                from peft import PeftModel

                model = PeftModel.from_pretrained(cls.from_pretrained(case["base_folder"]), case["folder"])
                found = {}
            else:
                model = cls.from_pretrained(case["folder"])
                found = {"layout": read_layout(model), "recipe": json.loads(json.dumps(model.config.zoo_recipe or []))}
            save_file({k: v.contiguous() for k, v in _forward(model, load_file(case["inputs"])).items()}, case["out"])
            out.append({"class": type(model).__name__, **found})
        except Exception as exc:  # noqa: BLE001 - reported by the checking process
            out.append({"error": "".join(traceback.format_exception_only(type(exc), exc)).strip()})
    Path(path + ".out").write_text(json.dumps(out))


def _compare(case) -> None:
    where, result = case["where"], case["reloaded"]
    if "error" in result:
        raise AssertionError(f"{where}: loading the saved model in a fresh process (import zoo, "
                             f"{case['auto']}.from_pretrained) failed: {result['error']}")
    if result["class"] != case["class"] and "base_folder" not in case:
        raise AssertionError(f"{where}: the fresh process loaded a {result['class']}, not a {case['class']}.")
    if "layout" in result and json.dumps(result["layout"]) != json.dumps(case["layout"]):
        raise AssertionError(f"{where}: the reloaded layout differs: {result['layout']} instead of {case['layout']}. "
                             "An option the module does not pass up to its base class is not saved.")
    if "recipe" in result and result["recipe"] != case["recipe"]:
        raise AssertionError(f"{where}: the reloaded recipe differs: {result['recipe']} instead of {case['recipe']}.")
    want, got = case["outputs"], result["outputs"]
    case["report"]["max_logit_diff"] = max(case["report"]["max_logit_diff"], _max_diff(got["logits"], want["logits"]))
    lost = [k for k in want if k not in got]
    if lost and "base_folder" not in case:  # PEFT's own load wraps the base in its own modules
        raise AssertionError(f"{where}: the model loaded in a fresh process lacks modules that ran in this one: "
                             f"{', '.join(k.split('#')[0] for k in lost[:3])}. Their structure is not saved.")
    for key in [k for k in want if k in got]:  # in the order they ran: the first one to differ is the culprit
        diff, scale = _max_diff(got[key], want[key]), want[key].abs().max().item()
        if diff > RELOAD_TOLERANCE * max(scale, 1e-6):
            what = "the logits differ" if key == "logits" else f"the output of {key.split('#')[0]} differs"
            raise AssertionError(
                f"{where}: after save_pretrained and a load in a fresh process {what} by up to {diff:.3g} "
                f"(largest value {scale:.3g}). Typical causes: a non-persistent buffer that no init_weights "
                "rebuilds (it comes back as uninitialised memory), a tensor whose dtype changes on load, or an "
                "option not passed to super().__init__ (so not saved).")
