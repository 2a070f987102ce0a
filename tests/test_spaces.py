"""The Gradio Spaces driven through their HTTP API with gradio_client, plus zoo.demos.spaces and ``moe-zoo demo``.

The helpers at the top (``default_model``, ``serve``) are shared with test_meta.py and test_browser.py.
"""
import base64
import contextlib
import math
import os
import socket
import urllib.request

import pytest

import zoo
from zoo.components.registry import get_model


def build_standin(path):
    """A random Mixtral (hidden 64, 2 layers, 8 experts, top-2) with the shipped tokenizer: a stand-in for
    zoo-tiny-moe while it is not in the checkout. Router weights get real spread, so routing is not a tie."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    from zoo.data.tokenizer import load_tokenizer

    tok = load_tokenizer()
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                           num_experts_per_tok=2, max_position_embeddings=512, bos_token_id=tok.bos_token_id,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = MixtralForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def default_model(tmp_path_factory):
    """What the Spaces load (``MOE_ZOO_MODEL``): as already set, else the shipped zoo-tiny-moe, else a stand-in."""
    if os.environ.get("MOE_ZOO_MODEL"):
        yield os.environ["MOE_ZOO_MODEL"]
        return
    shipped = get_model("zoo-tiny-moe").local_path
    value = "zoo-tiny-moe" if os.path.isfile(os.path.join(shipped, "config.json")) else \
        str(build_standin(tmp_path_factory.mktemp("zoo-tiny-moe-standin")))
    os.environ["MOE_ZOO_MODEL"] = value
    yield value
    os.environ.pop("MOE_ZOO_MODEL", None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(demo):
    """Launch a built ``gr.Blocks`` on 127.0.0.1 (a free port), check the page answers 200, yield its URL."""
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=free_port(), share=False,
                quiet=True)
    try:
        with urllib.request.urlopen(demo.local_url, timeout=30) as response:
            assert response.status == 200
        yield demo.local_url
    finally:
        demo.close()


@contextlib.contextmanager
def client_for(name):
    from gradio_client import Client

    from zoo.demos.spaces import load_app

    with serve(load_app(name).build_demo()) as url:
        yield Client(url, verbose=False, analytics_enabled=False, download_files=False)


@pytest.fixture(scope="module")
def explorer(default_model):
    with client_for("router-explorer") as client:
        yield client


@pytest.fixture(scope="module")
def model_zoo(default_model):
    with client_for("model-zoo") as client:
        yield client


TEXT = "To be, or not to be, that is the question.\nimport os\nprint(os.getcwd())"


def analyze(client, router, k, text=TEXT, **options):
    """router-explorer's /analyze with ``top_k=k`` and any other ``options`` of the router."""
    plot, ppl, table = client.predict(text, router, {"top_k": k, **options}, api_name="/analyze")
    experts = [[[int(e) for e in cell.split(", ")] for cell in row[1:]] for row in table["data"]]
    return plot, ppl, table, experts  # experts[token][layer] = the expert indices picked


# ---- router-explorer ----------------------------------------------------------------------------------

def test_explorer_returns_heatmap_perplexity_and_assignment(explorer):
    plot, ppl, table, experts = analyze(explorer, "topk-softmax", 2)
    assert plot["type"] == "matplotlib"
    head, _, data = plot["plot"].partition(",")
    assert head == "data:image/png;base64"
    png = base64.b64decode(data)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert isinstance(ppl, float) and math.isfinite(ppl) and ppl > 1
    n_layers = len(table["headers"]) - 1
    assert table["headers"] == ["token"] + [f"layer {i}" for i in range(n_layers)] and n_layers >= 2
    assert "".join(row[0] for row in table["data"]).replace("␣", " ").replace("⏎", "\n") == TEXT
    assert all(len(layer) == 2 and len(set(layer)) == 2 for row in experts for layer in row)


def test_explorer_top1_changes_assignment_and_perplexity(explorer):
    _, ppl2, _, experts2 = analyze(explorer, "topk-softmax", 2)
    _, ppl1, _, experts1 = analyze(explorer, "topk-softmax", 1)
    assert all(len(layer) == 1 for row in experts1 for layer in row)
    assert experts1 != experts2
    # in the first MoE layer (same input either way) top-1 keeps the most probable of the top-2 experts;
    # later layers see hidden states that top-1 already changed
    assert all(set(r1[0]) <= set(r2[0]) for r1, r2 in zip(experts1, experts2))
    assert abs(ppl1 - ppl2) > 1e-3 * ppl2, (ppl1, ppl2)
    # every analysis starts from a fresh copy of the base model: nothing accumulates
    _, again, _, experts_again = analyze(explorer, "topk-softmax", 2)
    assert experts_again == experts2 and again == pytest.approx(ppl2, rel=1e-6)


def test_explorer_lists_every_router(explorer):
    assert explorer.predict(api_name="/defaults") == "topk-softmax"  # the model's own router
    assert explorer.predict("topk-softmax", "mild", api_name="/router_preset") == {"top_k": 2, "norm_topk_prob": True}
    info = explorer.view_api(print_info=False, return_format="dict")
    params = info["named_endpoints"]["/analyze"]["parameters"]
    choices = next(p for p in params if p["parameter_name"] == "router")["type"]["enum"]
    assert set(choices) == {c["name"] for c in zoo.list_components("router")}
    _, ppl, _, _ = analyze(explorer, "sigmoid-bias", 2)
    assert math.isfinite(ppl)
    _, _, _, experts = analyze(explorer, "topk-softmax", 8)
    assert all(sorted(layer) == list(range(8)) for row in experts for layer in row)


def test_explorer_options_reach_the_router(explorer):
    """Options beyond top-k: top-p's p and steer's disabled experts change the assignment."""
    _, _, _, plain = analyze(explorer, "topk-softmax", 2)
    _, _, table = explorer.predict(TEXT, "top-p", {"p": 0.95}, api_name="/analyze")
    wide = [[[int(e) for e in cell.split(", ")] for cell in row[1:]] for row in table["data"]]
    assert max(len(layer) for row in wide for layer in row) > 2  # p=0.95 needs more than two experts somewhere
    off = {str(i): [e for e in range(8) if e not in (2, 5)] for i in range(len(plain[0]))}
    _, _, _, steered = analyze(explorer, "steer", 2, disable=off)
    assert all(sorted(layer) == [2, 5] for row in steered for layer in row)


def test_explorer_refuses_a_router_that_does_not_fit(explorer):
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match="language-conditioned does not fit this model"):
        analyze(explorer, "language-conditioned", 2)


# ---- model-zoo ------------------------------------------------------------------------------------------

def test_model_zoo_lists_models_and_components(model_zoo):
    models = model_zoo.predict(api_name="/models")
    names = [row[0] for row in models["data"]]
    assert "mixtral.zoo-tiny-moe" in names
    assert names == [e.name for e in zoo.list_models()]
    components = model_zoo.predict(api_name="/components")
    assert {(r[0], r[1]) for r in components["data"]} == {(c["kind"], c["name"]) for c in zoo.list_components()}


def test_model_zoo_renders_component_and_model_cards(model_zoo, default_model):
    card = model_zoo.predict("topk-softmax", api_name="/component_card")
    assert card.startswith("### Router: topk-softmax") and "norm_topk_prob" in card
    assert model_zoo.predict("mixtral", api_name="/component_card").startswith("### Architecture: mixtral")
    name = "mixtral.zoo-tiny-moe" if default_model == "zoo-tiny-moe" else default_model
    card = model_zoo.predict(name, api_name="/model_card")
    assert "## Recipe" in card and "### Router: topk-softmax" in card
    assert "library_name" not in card and "```yaml" not in card and not card.startswith("---")  # no YAML
    if default_model == "zoo-tiny-moe":  # the shipped model's own card, from its folder, rendered as markdown
        shipped = open(os.path.join(get_model("zoo-tiny-moe").local_path, "README.md")).read()
        assert card.startswith("# zoo-tiny-moe") and card in shipped


# ---- zoo.demos.spaces and the CLI -----------------------------------------------------------------------------

def test_space_dir_and_unknown_names():
    from zoo.demos.spaces import UnknownSpace, list_spaces, space_dir

    assert {"router-explorer", "model-zoo"} <= set(list_spaces())
    assert (space_dir("router-explorer") / "app.py").is_file()
    with pytest.raises(UnknownSpace, match="did you mean 'router-explorer'"):
        space_dir("router-explorr")


def test_demo_command():
    from click.testing import CliRunner

    from zoo.cli import cli

    result = CliRunner().invoke(cli, ["demo", "--help"])
    assert result.exit_code == 0 and "--port" in result.output
    result = CliRunner().invoke(cli, ["demo", "model-zo"])
    assert result.exit_code == 1 and "did you mean 'model-zoo'" in result.output


# ---- compression-lab ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lab(default_model):
    os.environ["MOE_ZOO_LAB_WINDOWS"] = "2"
    with client_for("compression-lab") as client:
        yield client
    os.environ.pop("MOE_ZOO_LAB_WINDOWS", None)


def test_lab_compresses_and_compares_with_the_base(lab):
    strong = lab.predict("prune-reap", "strong", api_name="/compressor_preset")
    assert strong == {"num_experts": 4}  # half of the layer's 8 experts
    _plot, table, _saliency = lab.predict("prune-reap", strong, api_name="/compress")
    assert table["visible"] is True  # hidden until the first run
    rows = {r[0]: r for r in table["value"]["data"]}
    assert set(rows) == {"base", "prune-reap num_experts=4"}
    base_mb, pruned_mb = rows["base"][1], rows["prune-reap num_experts=4"][1]
    assert pruned_mb == pytest.approx(base_mb / 2, rel=0.01)  # half the experts, half the expert bytes
    assert all(math.isfinite(v) and v > 1 for v in rows["prune-reap num_experts=4"][2:])
    _plot, table, _saliency = lab.predict("quantize", {"bits": 8}, api_name="/compress")
    rows = {r[0]: r for r in table["value"]["data"]}
    assert rows["quantize bits=8"][1] < 0.6 * rows["base"][1]  # int8 codes vs 16- or 32-bit floats


def test_lab_saliency_marks_the_pruned_experts(lab):
    """The saliency map crosses out the experts the last run removed (from its recipe step's results)."""
    from zoo.demos.spaces import load_app

    app = load_app("compression-lab")
    result = {"label": "prune-reap num_experts=6", "removed": {0: [1, 5], 1: [0, 7]}}
    fig = app.saliency(result)
    marks = [c for ax in fig.axes for c in ax.collections if c.get_offsets().shape[0]]
    assert {tuple(map(tuple, m.get_offsets().tolist())) for m in marks} >= {((1, 0), (5, 0)), ((0, 1), (7, 1))}
    for ax in fig.axes[:1]:
        assert all(float(t).is_integer() for t in ax.get_yticks())


def test_lab_names_the_best_shipped_recipe_within_a_budget(lab):
    """The grid moe-zoo compare measured for the shipped model: the best recipe within the budget, as the grid's own
    best_per_budget picks it, with its moe-zoo apply line."""
    from zoo.evaluation.compare import apply_line, best_per_budget, shipped_grid

    rows = shipped_grid("zoo-tiny-moe")
    assert rows, "no grid shipped for zoo-tiny-moe (zoo/_data/compare/zoo-tiny-moe.json)"
    for budget in (0.45, 0.7, 1.0):
        _plot, text = lab.predict(budget, api_name="/best_recipe")
        best = best_per_budget(rows, (budget,))[0]
        assert f"**{best['cell']}**" in text and apply_line("zoo-tiny-moe", best["steps"]) in text
    _plot, text = lab.predict(0.1, api_name="/best_recipe")  # below the smallest recipe of the grid
    assert "No recipe of the grid fits in 10%" in text


# ---- moe-zoo demo by component name: the zoo's components and a plugin's ----------------------------------

@pytest.fixture
def fake_plugin(tmp_path, monkeypatch):
    """A third-party package whose router lives in a subpackage and whose Space sits at the top of the package
    (``moe_zoo_fake/spaces/fake-space/``), registered for the test only; plus components naming a zoo Space, a
    missing Space and none."""
    import sys

    from zoo.components.registry import Registered, registry

    pkg = tmp_path / "moe_zoo_fake"
    (pkg / "parts").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "parts" / "__init__.py").write_text("")
    (pkg / "parts" / "router.py").write_text(
        "import zoo\n"
        "class Fake(zoo.Router):\n    name, space = 'fake-router', 'fake-space'\n"
        "class UsesZooSpace(zoo.Router):\n    name, space = 'fake-zoo-space', 'router-explorer'\n"
        "class Missing(zoo.Router):\n    name, space = 'fake-missing', 'nowhere'\n"
        "class NoSpace(zoo.Router):\n    name, space = 'fake-no-space', ''\n")
    (pkg / "spaces" / "fake-space").mkdir(parents=True)
    (pkg / "spaces" / "fake-space" / "app.py").write_text("def build_demo():\n    return 'fake demo'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from moe_zoo_fake.parts import router

    classes = [router.Fake, router.UsesZooSpace, router.Missing, router.NoSpace]
    entries = [Registered("router", c.name, c, "fake", "moe-zoo-fake", "1.0") for c in classes]
    registry.add_all(entries)
    yield router
    for e in entries:
        registry.by_kind["router"].pop(e.name, None)
    # dropped for good (monkeypatch's delitem would put them back at its own teardown, and the next test would
    # import this one's package from a folder that is gone)
    for name in [m for m in sys.modules if m.startswith("moe_zoo_fake")]:
        del sys.modules[name]


def test_find_space_by_component_or_space_name(fake_plugin):
    from zoo.demos.spaces import find_space, load_app, space_dir

    space, owner = find_space("fake-router")  # the component's own package first, though it sits one level up
    assert (space, owner) == ("fake-space", fake_plugin.Fake)
    assert space_dir(space, owner).parent.parent.name == "moe_zoo_fake"
    assert load_app(space, owner).build_demo() == "fake demo"
    assert find_space("fake-space") == ("fake-space", fake_plugin.Fake)  # a plugin's Space by its own name
    space, owner = find_space("fake-zoo-space")  # a plugin component shown by one of the zoo's Spaces
    assert space == "router-explorer" and space_dir(space, owner).parent.name in ("spaces", "_spaces")
    assert find_space("top-p")[0] == "router-explorer"  # a first-party component
    assert find_space("model-zoo") == ("model-zoo", None)  # the zoo's Spaces by name, as before


def test_find_space_errors_are_one_line_with_suggestions(fake_plugin):
    from zoo.demos.spaces import UnknownSpace, find_space

    with pytest.raises(UnknownSpace, match="no Space named 'fake-routr'; did you mean 'fake-router'"):
        find_space("fake-routr")
    with pytest.raises(UnknownSpace, match="did you mean 'fake-space'"):
        find_space("fake-spac")
    with pytest.raises(UnknownSpace, match="'fake-missing' names the Space 'nowhere', which is neither in .*moe_zoo_fake"):
        find_space("fake-missing")
    with pytest.raises(UnknownSpace, match="'fake-no-space' names no Space"):
        find_space("fake-no-space")


def test_demo_command_takes_component_names(fake_plugin, monkeypatch):
    from click.testing import CliRunner

    import zoo.demos.spaces
    from zoo.cli import cli

    served = []

    class Demo:  # stands in for the gr.Blocks: launching returns at once
        def launch(self, **kwargs):
            served.append(kwargs["server_name"])

    class App:
        build_demo = Demo

    def load_app(space, owner=None):
        served.append((space, owner))
        return App

    monkeypatch.setattr(zoo.demos.spaces, "load_app", load_app)
    result = CliRunner().invoke(cli, ["demo", "fake-router"])
    assert result.exit_code == 0, result.output
    assert served == [("fake-space", fake_plugin.Fake), "127.0.0.1"]
    result = CliRunner().invoke(cli, ["demo", "fake-routr"])
    assert result.exit_code == 1 and "did you mean 'fake-router'" in result.output
    assert len(result.output.strip().splitlines()) == 1
