"""Every registered component works in the Space of its kind, with the controls it declares (zoo.components.controls).

1. Every first-party component's declared defaults, presets and control ranges pass its own validation.
2. Every registered router, compressor and adapter (plugins' included) is driven through router-explorer,
   compression-lab and adapter-lab with gradio_client, with its mild preset (routers: strong too), read from the
   Space's own API: a real result, or, for one that does not fit the model, a clear error.
3. A plugin router that declares nothing gets controls from its signature and runs in router-explorer.
"""
import copy
import math
import os

import pytest

import zoo
from zoo.editing.apply import NoChange
from zoo.components.controls import PRESETS, Control, controls_for, defaults_of, presets_for, unfit_reason
from zoo.components.registry import registry

from test_spaces import TEXT, client_for, default_model  # noqa: F401  (shared fixture and helpers)

KINDS = ("router", "compressor", "adapter", "experts")
SPACE_OF_KIND = {"router": "router-explorer", "compressor": "compression-lab", "adapter": "adapter-lab"}


def registered(kind, first_party=False):
    return [c["name"] for c in zoo.list_components(kind) if not first_party or c["distribution"] == "moe-zoo"]


# ---- 1. declarations are options the components accept ------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    from zoo.io.convert import convert
    from zoo.testing import tiny_model

    return convert(tiny_model("mixtral")).eval()


def option_sets(cls, model) -> list[dict]:
    """The controls' defaults, each preset, and each control at its bounds or choices over the mild preset."""
    controls = controls_for(cls, model)
    presets = presets_for(cls, model)
    defaults = defaults_of(controls)
    base = {**defaults, **presets["mild"]}
    sets = [defaults, *presets.values()]
    for c in controls:
        values = list(c.choices) if c.kind == "choice" else [v for v in (c.low, c.high) if v is not None]
        values += [True, False] if c.kind == "bool" else []
        for value in values:
            value = int(value) if c.kind == "int" else value
            sets.append({**base, c.name: value})
    return sets


def check(kind, name, cls, options, model):
    """Raise unless ``options`` pass the component's own checks (on ``model``, where given)."""
    if kind == "router":
        if model is None:
            return zoo.components.options.check_options(cls, options, skip=("hidden_size", "num_experts"))
        try:
            zoo.apply(copy.deepcopy(model), name, **options)
        except NoChange:
            pass
    elif kind == "compressor":
        compressor = cls(**options)
        if model is not None and not unfit_reason(cls, model):
            from zoo.moe.layout import moe_layers

            for i, block in moe_layers(model):
                compressor.check_layer(i, block)
    elif kind == "adapter":
        cls(**options)
    else:
        zoo.components.options.check_options(cls, options)


@pytest.mark.parametrize("kind, name", [(k, n) for k in KINDS for n in registered(k, first_party=True)])
def test_declared_controls_and_presets_pass_validation(kind, name, tiny):
    cls = registry.get(kind, name).obj
    for model in (None, tiny):
        controls = controls_for(cls, model)
        assert all(isinstance(c, Control) for c in controls)
        assert len({c.name for c in controls}) == len(controls)
        presets = presets_for(cls, model)
        assert set(presets) == set(PRESETS)
        names = {c.name for c in controls}
        for preset in presets.values():
            assert set(preset) <= names, f"{name}: preset options {set(preset) - names} have no control"
        for c in controls:
            if c.low is not None and c.high is not None:
                assert c.low <= c.high, c
            if c.default is not None and c.kind in ("int", "float") and c.low is not None and c.high is not None:
                assert c.low <= c.default <= c.high, c
            if c.kind == "choice":
                assert c.default in c.choices, c
        for options in option_sets(cls, model):
            try:
                check(kind, name, cls, options, model)
            except (ValueError, TypeError) as exc:
                raise AssertionError(f"{kind} {name} refuses its own declared options {options}: {exc}") from None


def test_controls_from_a_bare_signature():
    """A component that declares nothing gets controls built from its __init__ (zoo.components.options.describe_options)."""
    class Bare(zoo.Compressor):
        name = "bare"

        def __init__(self, num_experts: int, strength: float = 0.5, mode: str = "a", on: bool = True,
                     layers: list | None = None):
            super().__init__(num_experts=num_experts, strength=strength, mode=mode, on=on, layers=layers)

    controls = {c.name: c for c in controls_for(Bare)}
    assert [c.kind for c in controls.values()] == ["int", "float", "text", "bool", "json"]
    assert controls["num_experts"].default == 6 and controls["strength"].default == 0.5
    assert presets_for(Bare)["mild"] == {"num_experts": 6, "strength": 0.5, "mode": "a", "on": True}


# ---- 2. every registered component through its Space --------------------------------------------------------

@pytest.fixture(scope="module")
def explorer(default_model):  # noqa: F811
    with client_for("router-explorer") as client:
        yield client


def analyze(client, router, options):
    plot, ppl, table = client.predict(TEXT, router, options, api_name="/analyze")
    experts = [[[int(e) for e in cell.split(", ") if e] for cell in row[1:]] for row in table["data"]]
    return plot, ppl, experts


@pytest.fixture(scope="module")
def plain(explorer):
    """Plain top-k: the model's own router and k."""
    options = explorer.predict("topk-softmax", "mild", api_name="/router_preset")
    _, ppl, experts = analyze(explorer, "topk-softmax", options)
    return ppl, experts


@pytest.mark.parametrize("name", registered("router"))
def test_every_router_in_router_explorer(explorer, plain, name):
    from gradio_client.exceptions import AppError

    cls = registry.get("router", name).obj
    for preset in PRESETS:
        options = explorer.predict(name, preset, api_name="/router_preset")
        assert isinstance(options, dict)
        if name == "language-conditioned":  # needs a multimodal prompt context: says so, shows nothing
            with pytest.raises(AppError, match="does not fit this model.*prompt"):
                analyze(explorer, name, options)
            continue
        if name == "product-key":  # zoo-tiny-moe's 8 experts are no square
            with pytest.raises(AppError, match="does not fit this model.*8 experts, no square"):
                analyze(explorer, name, options)
            continue
        plot, ppl, experts = analyze(explorer, name, options)
        assert plot["type"] == "matplotlib" and math.isfinite(ppl) and ppl > 1
        assert len(experts) == len(plain[1]) and all(len(row) == len(plain[1][0]) for row in experts)
        if (name, preset) != ("topk-softmax", "mild") and getattr(cls, "__module__", "").startswith(
                ("zoo_routers", "zoo_multimodal")):
            assert (experts, round(ppl, 3)) != (plain[1], round(plain[0], 3)), f"{name} {preset} is plain top-k"
        if name == "steer":  # the disabled experts are never picked
            for row in experts:
                for layer, picked in enumerate(row):
                    assert not set(picked) & set(options["disable"].get(str(layer), [])), (preset, row)
        if name == "top-p" and preset == "mild":  # a variable number of experts per token
            assert len({len(layer) for row in experts for layer in row}) > 1


@pytest.fixture(scope="module")
def lab(default_model):  # noqa: F811
    os.environ.update(MOE_ZOO_LAB_WINDOWS="1", MOE_ZOO_LAB_TOKENS="1024")
    with client_for("compression-lab") as client:
        yield client
    for var in ("MOE_ZOO_LAB_WINDOWS", "MOE_ZOO_LAB_TOKENS"):
        os.environ.pop(var, None)


def rows_of(update):
    table = update["value"] if isinstance(update, dict) and "__type__" in update else update
    return {row[0]: row for row in table["data"]}


@pytest.mark.parametrize("name", registered("compressor"))
def test_every_compressor_in_compression_lab(lab, name):
    from gradio_client.exceptions import AppError

    cls = registry.get("compressor", name).obj
    options = lab.predict(name, "mild", api_name="/compressor_preset")
    if name == "prune-group":  # modality-groups experts only: says so
        with pytest.raises(AppError, match="does not fit this model.*modality-groups"):
            lab.predict(name, options, api_name="/compress")
        return
    plot, table, saliency = lab.predict(name, options, api_name="/compress")
    rows = rows_of(table)
    label = f"{name} " + ", ".join(f"{k}={v}" for k, v in options.items())
    assert label in rows and "base" in rows
    assert plot["type"] == "matplotlib" and saliency["type"] == "matplotlib"
    assert all(math.isfinite(v) and v > 1 for v in rows[label][2:])
    assert rows[label][1:] != rows["base"][1:]  # bytes or perplexity moved
    if "num_experts" in options and getattr(cls, "needs_calibration", False) and name != "prune-group":
        assert rows[label][1] < rows["base"][1]


def test_quantize_mixed_precision_is_reachable(lab):
    """PMQ and AlphaQ (quantize's mixed-precision allocations) through the lab's own controls."""
    strong = lab.predict("quantize", "strong", api_name="/compressor_preset")
    assert strong["allocation"] == "pmq" and strong["bits"] not in (2, 3, 4, 8)
    for allocation in ("pmq", "alphaq"):
        _, table, _ = lab.predict("quantize", {**strong, "allocation": allocation}, api_name="/compress")
        rows = rows_of(table)
        label = "quantize " + ", ".join(f"{k}={v}" for k, v in {**strong, "allocation": allocation}.items())
        assert rows[label][1] < 0.6 * rows["base"][1]


@pytest.fixture(scope="module")
def adapter_lab(default_model):  # noqa: F811
    os.environ["MOE_ZOO_LAB_WINDOWS"] = "1"
    with client_for("adapter-lab") as client:
        yield client
    os.environ.pop("MOE_ZOO_LAB_WINDOWS", None)


@pytest.mark.parametrize("name", registered("adapter"))
def test_every_adapter_in_adapter_lab(adapter_lab, name):
    from gradio_client.exceptions import AppError

    options = adapter_lab.predict(name, "mild", api_name="/adapter_preset")
    if name == "earth-adapter":  # adapts zoo_mm's vision encoder: the lab's text model says it does not fit
        with pytest.raises(AppError, match="does not fit this model.*no vision encoder"):
            adapter_lab.predict(name, options, "code", 1, 1e-3, api_name="/finetune")
        return
    table, plot = adapter_lab.predict(name, options, "code", 1, 1e-3, api_name="/finetune")
    rows = rows_of(table)
    assert set(rows) == {"english", "code"} and plot["type"] == "matplotlib"
    assert all(math.isfinite(r[1]) and math.isfinite(r[2]) for r in rows.values())
    assert any(r[1] != r[2] for r in rows.values())  # one step of training moved held-out perplexity


# ---- 3. a plugin router that declares nothing -----------------------------------------------------------------

@pytest.fixture
def plugin_router():
    import torch.nn.functional as F

    from zoo.components.registry import Registered

    class Tempered(zoo.Router):
        """Top-k softmax over logits divided by a temperature.

        temperature: softmax temperature
        """
        name, space = "tempered-topk", "router-explorer"
        summary = "top-k over tempered softmax"

        def __init__(self, hidden_size, num_experts, top_k, temperature: float = 1.0, **options):
            if not temperature > 0:
                raise ValueError("temperature must be positive")
            super().__init__(hidden_size, num_experts, top_k, temperature=temperature, **options)
            self.temperature = temperature

        def forward(self, hidden):
            logits = self.gate_logits(hidden)
            probs = F.softmax(logits.float() / self.temperature, dim=-1)
            top, indices = probs.topk(self.top_k, dim=-1)
            return zoo.Routing(weights=(top / top.sum(-1, keepdim=True)).to(hidden.dtype), indices=indices,
                               logits=logits)

    entry = Registered("router", Tempered.name, Tempered, "tempered", "moe-zoo-tempered", "1.0")
    registry.add_all([entry])
    yield Tempered
    registry.by_kind["router"].pop(Tempered.name, None)


def test_plugin_router_without_declarations_in_router_explorer(plugin_router, default_model):  # noqa: F811
    with client_for("router-explorer") as client:
        options = client.predict("tempered-topk", "mild", api_name="/router_preset")
        assert options == {"top_k": 2, "temperature": 1.0}
        _, ppl1, experts1 = analyze(client, "tempered-topk", {"top_k": 1, "temperature": 1.0})
        _, ppl3, experts3 = analyze(client, "tempered-topk", {"top_k": 3, "temperature": 2.0})
        assert all(len(layer) == 1 for row in experts1 for layer in row)
        assert all(len(layer) == 3 for row in experts3 for layer in row) and ppl1 != ppl3
