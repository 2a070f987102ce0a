"""Plugin loading: a real pip-installed third-party plugin, broken plugins, clashes, selection by env."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parent / "plugin_example"


def run(args, site=None, env_extra=None, code=None):
    env = dict(os.environ)
    env.pop("MOE_ZOO_LOAD_PLUGINS", None)
    if site:
        env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    env.update(env_extra or {})
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "zoo.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """tests/plugin_example really pip-installed (no deps, no build isolation) into its own folder."""
    target = tmp_path_factory.mktemp("site")
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--target", str(target), str(EXAMPLE)], capture_output=True, text=True)
    assert pip.returncode == 0, pip.stderr
    assert list(target.glob("moe_zoo_example_plugin-0.3.0.dist-info"))
    return target


def fake_dist(site: Path, dist: str, module: str, source: str) -> None:
    """A minimal installed distribution (dist-info + entry point) that importlib.metadata discovers."""
    (site / f"{module}.py").write_text(source)
    info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[moe_zoo]\n{module} = {module}\n")


def plugins_json(site, env_extra=None):
    res = run(["plugins"], site, env_extra)
    assert res.returncode == 0, res.stderr
    return {p["name"]: p for p in json.loads(res.stdout)}


def test_installed_plugin_is_listed(site):
    found = plugins_json(site)
    row = found["example"]
    assert row["distribution"] == "moe-zoo-example-plugin" and row["version"] == "0.3.0"
    assert row["hooks"] == ["register_routers"]
    assert row["components"] == ["router:example-switch-top1"]
    assert "error" not in row


def test_installed_plugin_is_usable_through_apply(site):
    code = """
import sys; sys.path.insert(0, %r)
import torch, zoo
from tiny import tiny_native, padded_batch
m = zoo.convert(tiny_native("mixtral"))
zoo.apply(m, "example-switch-top1")
ids, mask = padded_batch()
out = m(input_ids=ids, attention_mask=mask, output_router_logits=True)
layers = [l.mlp for l in m.model.layers]
assert all(type(b.router).__name__ == "SwitchTop1" and b.top_k == 1 for b in layers)
assert m.config.zoo_recipe[-1]["name"] == "example-switch-top1"
print("OK", tuple(out.logits.shape))
""" % str(Path(__file__).parent)
    res = run([], site, code=code)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "OK (2, 8, 128)" in res.stdout


@pytest.mark.parametrize("wanted,selected,warned", [
    ("", [], False), ("moe-zoo-example-plugin", ["example"], False), ("moe_zoo.Example_Plugin", ["example"], False),
    ("example", ["example"], False), ("other, example", ["example"], True), ("other", [], True)])
def test_env_var_selects_plugins(site, monkeypatch, wanted, selected, warned):
    """The selection on the installed example's real entry point (by entry-point or distribution name, in any
    spelling pip accepts; unknown names warned about), in this process; one fresh process below runs it whole."""
    import importlib.metadata as md
    import warnings

    from zoo.components import plugins

    found = [ep for dist in md.distributions(path=[str(site)]) for ep in dist.entry_points if ep.group == "moe_zoo"]
    monkeypatch.setattr(plugins.md, "entry_points", lambda group: [ep for ep in found if ep.group == group])
    monkeypatch.setenv("MOE_ZOO_LOAD_PLUGINS", wanted)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [ep.name for ep in plugins._selected_entry_points()] == selected
    assert any("no installed plugin is named 'other'" in str(w.message) for w in caught) == warned


def test_env_var_selects_plugins_in_a_fresh_process(site):
    res = run(["plugins"], site, {"MOE_ZOO_LOAD_PLUGINS": "other, example"})
    assert res.returncode == 0, res.stderr
    assert "example" in {p["name"] for p in json.loads(res.stdout)}
    assert "no installed plugin is named 'other'" in res.stderr and "example" in res.stderr.split("entry points:")[1]
    assert "example" not in plugins_json(site, {"MOE_ZOO_LOAD_PLUGINS": ""})


def test_broken_plugins_are_reported_and_the_rest_load(site, tmp_path):
    fake_dist(tmp_path, "bad-import", "bad_import", "raise RuntimeError('boom at import')\n")
    fake_dist(tmp_path, "bad-register", "bad_register",
              "import zoo\n@zoo.hookimpl\ndef register_routers(register):\n    raise RuntimeError('boom in hook')\n")
    fake_dist(tmp_path, "clashing-plugin", "clashing",
              "import zoo\nclass R(zoo.Router):\n    name = 'topk-softmax'\n"
              "@zoo.hookimpl\ndef register_routers(register):\n    register(R)\n")
    found = plugins_json(os.pathsep.join([str(tmp_path), str(site)]))
    assert found["bad_import"]["error"] == "import: RuntimeError: boom at import"  # one line for users
    assert "bad_import.py" in found["bad_import"]["traceback"]  # the details, for debugging
    assert found["bad_register"]["error"] == "register_routers: RuntimeError: boom in hook"
    clash = found["clashing"]["error"]
    assert "topk-softmax" in clash and "moe-zoo" in clash and "clashing-plugin" in clash
    assert found["example"]["components"] == ["router:example-switch-top1"]  # the good one still loads
    res = run(["components", "router"], os.pathsep.join([str(tmp_path), str(site)]))
    assert res.returncode == 0
    assert "example-switch-top1" in res.stdout and "topk-softmax" in res.stdout


def test_importing_a_first_party_plugin_before_zoo_still_registers_it():
    """``import zoo_routers.x`` imports zoo, which loads plugins while zoo_routers is mid-import: that plugin
    must be registered on the next load instead of being recorded without its hooks."""
    code = ("from zoo_routers.top_p import TopP\nimport zoo\n"
            "print(sorted(c['name'] for c in zoo.list_components('router')))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "'top-p'" in run.stdout and "'topk-softmax'" in run.stdout, run.stdout
