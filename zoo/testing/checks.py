"""``check_component`` / ``check_components``: bad options, apply and recipe, save, card; the fresh process
(``zoo.testing.fresh_process``) and the references (``zoo.testing.reference``) do the rest."""
from __future__ import annotations

import contextlib
import copy
import json
import os
import tempfile
from pathlib import Path

import torch

from zoo.testing.fresh_process import compare_reloaded, reload_all
from zoo.testing.outputs import is_peft, logits_of, max_diff, module_outputs, unwrapped
from zoo.testing.plugins import register_plugin, unregister
from zoo.testing.reference import check_references
from zoo.testing.tiny import TINY, calibration_for, sample_inputs, tiny_model

# Conversion (native -> zoo) computes the same function with other kernels (fused experts, another summation order).
CONVERT_TOLERANCE = 1e-5
AUTO = {"causal-lm": "AutoModelForCausalLM", "image-text-to-text": "AutoModelForImageTextToText",
        "seq2seq-lm": "AutoModelForSeq2SeqLM", "multimodal-lm": "AutoModelForMultimodalLM"}
FAMILIES = ("mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss", "mistral", "zoo_mm")  # what a component is checked on


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
    from zoo.components.plugins import load_plugins

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
                reload_all(cases, plugins, tmp)
            except AssertionError as exc:  # the fresh process itself failed: every check that reached it fails
                for report in {id(c["report"]): c["report"] for c in cases}.values():
                    _fail(report, exc, strict)
            for case in cases:
                report = case["report"]
                if "failure" not in report and "reloaded" in case:
                    try:
                        compare_reloaded(case)
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
            report["references"] = sorted(set(report["references"]) | set(check_references(case, where)))
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
    from zoo.components.registry import registry

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
    from zoo.moe.layout import family_and_base

    fam, _ = family_and_base(model)
    return fam.name if fam is not None else model.config.model_type


def _state(model):
    """What must not change: the class, the structure, the config and every tensor's bytes (buffers that are not
    saved included)."""
    from zoo.editing.snapshot import Fingerprint

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
    from zoo.components.options import accepted_options, annotated_types

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
    case = {"model": model, "new": [c for c in _part_classes(unwrapped(model)) if c not in classes] + [cls]}
    if is_peft(model):
        case["base"] = base  # a PEFT result saves only its adapter
    return case


def _shapes(model) -> dict[str, tuple]:
    """Tensor name -> shape, with PEFT's ``base_layer`` wrappers left out of the names."""
    return {n.replace(".base_layer", ""): tuple(t.shape) for n, t in unwrapped(model).state_dict().items()}


def _as_if_trained(model, before: dict[str, tuple], seed: int = 0) -> None:
    """Seeded noise on the tensors the step added (names or shapes the model did not have) that hold one constant
    (a LoRA's zero B, a zero router, a zero bias): training would move them, and a load that re-initialises or drops
    them must show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, t in unwrapped(model).state_dict().items():
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


def build_experts(cls, block, options: dict, seed: int = 0):
    """Experts of kind ``cls`` for ``block`` (see the module docstring)."""
    from zoo.components.options import accepted_options

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
    from zoo.moe.layout import moe_layers, set_block, sync_layout
    from zoo.components.options import accepted_options

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
    own = getattr(fam, "native_logits", None)  # a third-party family may predate it
    native = own(model.eval(), inputs) if own else None
    native = logits_of(model, inputs) if native is None else native.detach().float()
    model = zoo.convert(model)
    converted = logits_of(model, inputs)
    diff = max_diff(converted, native)
    if diff > CONVERT_TOLERANCE * max(native.abs().max().item(), 1e-6):
        raise AssertionError(f"{where}: zoo.convert changed the logits by up to {diff:.3g} (largest logit "
                             f"{native.abs().max().item():.3g}); conversion must be lossless.")
    return {"model": model, "new": None}


def _part_classes(model) -> list[type]:
    from zoo.moe.layout import moe_layers

    try:
        layers = moe_layers(model)
    except Exception:  # noqa: BLE001 - a model the zoo cannot read (a dense one) has no parts
        return []
    return list(dict.fromkeys(type(p) for _, moe in layers for p in (moe.router, moe.experts)))


def _save(case) -> None:
    """Save the model (and the base of a PEFT adapter) and record what the fresh process must reproduce."""
    from zoo.architectures.lookup import family_of
    from zoo.moe.layout import read_layout

    model, where = case["model"], case["where"]
    case["inputs"] = sample_inputs(model)
    logits = logits_of(model, case["inputs"])
    model.save_pretrained(case["folder"])
    case["outputs"] = module_outputs(model, case["inputs"])
    if not torch.equal(logits, case["outputs"]["logits"]):
        raise AssertionError(f"{where}: save_pretrained changed the model's logits (by up to "
                             f"{max_diff(case['outputs']['logits'], logits):.3g}).")
    zoo_model = unwrapped(model)
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
    from zoo.publishing.cards import render_component_card
    from zoo.architectures.lookup import family_of

    model, where = unwrapped(case["model"]), case["where"]
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
