"""Meta tests (datasette style): every registered component has a card that renders and a Space that exists,
is described for Hugging Face Spaces, builds, launches and mentions it. Third-party components too: the
example plugin is pip-installed into a tmp folder and this file is re-run with it on PYTHONPATH."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gradio
import pytest
from huggingface_hub import SpaceCard

import zoo
from zoo.publishing.cards import render_component_card
from zoo.components.registry import registry
from zoo.components.resources import resource_path
from zoo.demos.spaces import load_app, space_dir

from test_spaces import default_model, serve  # noqa: F401  (shared fixture and helper)

COMPONENTS = zoo.list_components()
IDS = [f"{c['kind']}:{c['name']}" for c in COMPONENTS]
FRONT_MATTER = ("title", "emoji", "sdk", "sdk_version", "app_file", "models", "tags")
EXAMPLE_PLUGIN = Path(__file__).parent / "plugin_example"


def owner(component: dict):
    return registry.get(component["kind"], component["name"]).obj


@pytest.mark.parametrize("component", COMPONENTS, ids=IDS)
def test_component_has_a_card_that_renders(component):
    assert component["card"], f"{component['name']} has no `card` template"
    assert resource_path(component["card"], owner=owner(component)).is_file()
    family = component["name"] if component["kind"] == "architecture" else "mixtral"
    context = {"family": family, "layout_summary": "L0: 8 x swiglu experts, topk-softmax top-2", "recipe": []}
    text = render_component_card(owner(component), context)
    assert text.startswith("#") and len(text.strip().splitlines()) > 1, text[:200]  # a heading, then text


def check_space(name: str, component_owner) -> dict:
    """Files, front matter, requirements; build the app, launch it and fetch its page. Returns its config."""
    folder = space_dir(name, owner=component_owner)
    for file in ("app.py", "README.md", "requirements.txt"):
        assert (folder / file).is_file(), f"spaces/{name}/{file} is missing"
    meta = SpaceCard.load(folder / "README.md").data.to_dict()
    missing = [key for key in FRONT_MATTER if key not in meta]
    assert not missing, f"spaces/{name}/README.md front matter lacks {missing}"
    assert meta["sdk"] == "gradio" and meta["sdk_version"] == gradio.__version__, meta
    assert (folder / meta["app_file"]).is_file() and isinstance(meta["models"], list) and meta["tags"]
    pins = dict(line.split("==", 1) for line in (folder / "requirements.txt").read_text().split() if "==" in line)
    assert pins.get("gradio") == gradio.__version__ and "moe-zoo" in pins, pins
    app = load_app(name, owner=component_owner)
    demo = app.build_demo()
    assert isinstance(demo, gradio.Blocks)
    with serve(demo):  # launch on 127.0.0.1, GET / must answer 200
        config = demo.get_config_file()
    return config


@pytest.fixture(scope="module")
def spaces(default_model):  # noqa: F811
    """Each Space is checked (and launched) once; the components it demonstrates share the result."""
    done = {}

    def get(name, component_owner):
        if isinstance(done.get(name), Exception):  # fail every component of a broken Space, briefly
            pytest.fail(f"the {name!r} Space failed its check: {type(done[name]).__name__}: {done[name]}",
                        pytrace=False)
        if name not in done:
            try:
                done[name] = check_space(name, component_owner)
            except Exception as exc:
                done[name] = exc
                raise
        return done[name]

    return get


@pytest.mark.parametrize("component", COMPONENTS, ids=IDS)
def test_component_has_a_space_that_launches(component, spaces):
    assert component["space"], f"{component['name']} names no `space`"
    config = spaces(component["space"], owner(component))
    assert json.dumps(config, default=str).count(json.dumps(component["name"])) > 0, \
        f"the {component['space']} Space never mentions {component['name']} (e.g. in a dropdown)"


def test_third_party_components(tmp_path, default_model):  # noqa: F811
    """The example plugin, really pip-installed: its components pass the same checks in a subprocess."""
    site, source = tmp_path / "site", tmp_path / "plugin"  # build from a copy: no build/ left in tests/
    shutil.copytree(EXAMPLE_PLUGIN, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--target", str(site), str(source)], capture_output=True, text=True)
    assert pip.returncode == 0, pip.stderr
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
           "MOE_ZOO_MODEL": default_model}
    env.pop("MOE_ZOO_LOAD_PLUGINS", None)
    listing = subprocess.run([sys.executable, "-c", "import json, zoo; print(json.dumps([c['kind'] + ':' + "
                              "c['name'] for c in zoo.list_components() if c['distribution'] != 'moe-zoo']))"],
                             capture_output=True, text=True, env=env, timeout=300)
    assert listing.returncode == 0, listing.stderr[-3000:]
    third_party = json.loads(listing.stdout.strip().splitlines()[-1])
    assert "router:example-switch-top1" in third_party
    selected = " or ".join(f"[{i}]" for i in third_party)
    run = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider",
                          "-k", selected], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-3000:]
    assert f"{2 * len(third_party)} passed" in run.stdout, run.stdout[-2000:]
