"""Plugins cannot take the zoo down: each failure is isolated, reported as that plugin's one-line error, and the
zoo and the other plugins still load. Third-party plugins are faked in-process (their module files in tmp_path,
their entry points by patching ``importlib.metadata.entry_points``); the fixture restores the global plugin
state after each test. Two subprocess tests check ``import zoo`` and ``moe-zoo plugins`` end to end."""
import importlib
import importlib.metadata as md
import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import click
import pytest
from click.testing import CliRunner

import zoo
import zoo.components.plugins as P
from zoo.cli import cli as builtin_cli
from zoo.components.registry import get_model
from zoo.io.loading import resolve_path

ROUTER = """
import zoo
class R(zoo.Router):
    name = {name!r}
@zoo.hookimpl
def register_routers(register):
    register(R)
"""
MODEL = """
import zoo
from zoo.components.registry import ModelEntry
@zoo.hookimpl
def register_models(register):
    register(ModelEntry({name!r}, "org/{name}", "mixtral", "mit", "a paper"))
"""
COMMAND = """
import click
import zoo
@zoo.hookimpl
def register_commands(cli):
    for name in {names!r}:
        cli.add_command(click.Command(name, callback=lambda n=name: click.echo("from {module}: " + n)))
"""


class FakeEntryPoint:
    def __init__(self, name, module, dist):
        self.name, self.module, self.dist = name, module, SimpleNamespace(name=dist, version="1.0")

    def load(self):
        return importlib.import_module(self.module)


@pytest.fixture
def plugins(monkeypatch, tmp_path):
    """``plugins.add(module, source)`` installs a fake third-party plugin; ``plugins.load()`` loads the new ones
    and returns ``plugin_report()`` by name. Everything the test changed in the plugin state is undone after."""
    eps, modules = [], []
    real = md.entry_points
    monkeypatch.setattr(md, "entry_points", lambda **kw: list(eps) if kw.get("group") == "moe_zoo" else real(**kw))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("MOE_ZOO_LOAD_PLUGINS", raising=False)

    def add(module, source, dist=None, ep=None):
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        eps.append(FakeEntryPoint(ep or module, module, dist or module.replace("_", "-")))
        modules.append(module)

    def load():
        P.load_new_plugins()
        return {row["name"]: row for row in P.plugin_report()}

    with P.restored_state():
        yield SimpleNamespace(add=add, load=load)
    for module in modules:
        sys.modules.pop(module, None)


def one_line(error: str) -> str:
    assert "\n" not in error and "Traceback" not in error, error
    return error


def test_broken_architecture_registration_is_reported(plugins):
    plugins.add("bad_arch", """
        import zoo
        class Broken:
            name = "broken-arch"
            def register_auto_classes(self):
                raise RuntimeError("cannot register the auto classes")
        @zoo.hookimpl
        def register_architectures(register):
            register(Broken())
        """)
    plugins.add("good_one", ROUTER.format(name="good-router"))
    found = plugins.load()
    assert one_line(found["bad_arch"]["error"]) == (
        "architecture 'broken-arch': RuntimeError: cannot register the auto classes")
    assert "cannot register the auto classes" in found["bad_arch"]["traceback"]
    assert "broken-arch" not in P.registry.by_kind["architecture"]  # half-registered: taken out
    assert found["good_one"]["components"] == ["router:good-router"] and "error" not in found["good_one"]
    assert {"mixtral", "qwen3_moe"} <= {c["name"] for c in zoo.list_components("architecture")}


def test_system_exit_at_import_is_reported(plugins):
    plugins.add("exits_at_import", "import sys\nsys.exit(3)\n")
    plugins.add("good_one", ROUTER.format(name="good-router"))
    found = plugins.load()
    assert one_line(found["exits_at_import"]["error"]) == "import: SystemExit: 3"
    assert found["good_one"]["components"] == ["router:good-router"]


def test_system_exit_inside_a_hook_is_reported(plugins):
    plugins.add("exits_in_hook", """
        import zoo
        @zoo.hookimpl
        def register_routers(register):
            raise SystemExit("bye")
        """)
    plugins.add("good_one", ROUTER.format(name="good-router"))
    found = plugins.load()
    assert one_line(found["exits_in_hook"]["error"]) == "register_routers: SystemExit: bye"
    assert found["exits_in_hook"]["components"] == []
    assert found["good_one"]["components"] == ["router:good-router"]


def test_a_raising_hook_adds_none_of_its_components(plugins):
    plugins.add("half_done", """
        import zoo
        class R(zoo.Router):
            name = "half-router"
        @zoo.hookimpl
        def register_routers(register):
            register(R)
            raise RuntimeError("boom in hook\\nwith a second line")
        """)
    found = plugins.load()
    assert one_line(found["half_done"]["error"]) == "register_routers: RuntimeError: boom in hook with a second line"
    assert "half_done.py" in found["half_done"]["traceback"]
    assert "half-router" not in P.registry.by_kind["router"]


def test_a_hook_with_a_wrong_signature_is_reported(plugins):
    plugins.add("wrong_args", """
        import zoo
        @zoo.hookimpl
        def register_routers(reg):
            pass
        """)
    plugins.add("good_one", ROUTER.format(name="good-router"))
    found = plugins.load()
    error = one_line(found["wrong_args"]["error"])
    assert error.startswith("import: PluginValidationError: Plugin 'wrong_args' for hook 'register_routers'")
    assert "{'reg'}" in error  # the cause, not only the first line of pluggy's message
    assert found["good_one"]["components"] == ["router:good-router"]


def test_keyboard_interrupt_is_not_swallowed(plugins):
    plugins.add("interrupted", """
        import zoo
        @zoo.hookimpl
        def register_routers(register):
            raise KeyboardInterrupt
        """)
    with pytest.raises(KeyboardInterrupt):
        plugins.load()


def test_a_plugin_command_cannot_replace_a_builtin(plugins):
    plugins.add("cmds", COMMAND.format(names=["convert", "hello"], module="cmds"))
    plugins.load()
    group = click.Group("moe-zoo", commands=dict(builtin_cli.commands))
    P.commands_hook(group)
    P.commands_hook(group)  # a second call adds nothing and reports nothing twice
    assert group.commands["convert"] is builtin_cli.commands["convert"]
    assert one_line(P.errors["cmds"]) == (
        "register_commands: command 'convert' would replace the built-in `moe-zoo convert`; not added")
    res = CliRunner().invoke(group, ["hello"])
    assert res.exit_code == 0 and res.output == "from cmds: hello\n"
    assert "hello" not in builtin_cli.commands


def test_two_plugins_clashing_on_a_command_first_wins(plugins):
    plugins.add("cmds_a", COMMAND.format(names=["hello"], module="cmds_a"))
    plugins.add("cmds_b", COMMAND.format(names=["hello", "bye"], module="cmds_b"))
    plugins.load()
    group = click.Group("moe-zoo")
    P.commands_hook(group)
    assert CliRunner().invoke(group, ["hello"]).output == "from cmds_a: hello\n"
    assert CliRunner().invoke(group, ["bye"]).output == "from cmds_b: bye\n"
    assert P.errors["cmds_b"] == "register_commands: command 'hello' is already added by plugin 'cmds_a'; not added"
    assert "cmds_a" not in P.errors


def test_two_plugins_clashing_on_a_component_name(plugins):
    plugins.add("first_comp", ROUTER.format(name="shared-router"))
    plugins.add("second_comp", ROUTER.format(name="shared-router"), dist="second-dist")
    plugins.add("takes_own", ROUTER.format(name="topk-softmax"))
    found = plugins.load()
    assert P.registry.by_kind["router"]["shared-router"].plugin == "first_comp"
    assert one_line(found["second_comp"]["error"]) == (
        "registration: ValueError: router 'shared-router' is registered twice: by first-comp (first_comp) "
        "and by second-dist (second_comp)")
    assert P.registry.by_kind["router"]["topk-softmax"].distribution == "moe-zoo"
    assert "by moe-zoo (zoo_routers)" in found["takes_own"]["error"]


def test_a_name_registered_twice_by_one_plugin_is_refused(plugins):
    plugins.add("twice", """
        import zoo
        class A(zoo.Router):
            name = "twice-router"
        class B(zoo.Router):
            name = "twice-router"
        @zoo.hookimpl
        def register_routers(register):
            register(A)
            register(B)
        """)
    found = plugins.load()
    assert "router 'twice-router' is registered twice" in found["twice"]["error"]
    assert "twice-router" not in P.registry.by_kind["router"]


def test_model_short_name_resolves_to_the_zoos_own(plugins):
    plugins.add("shadow_tag", MODEL.format(name="evil.zoo-tiny-moe"))
    plugins.add("shadow_full", MODEL.format(name="zoo-tiny-moe"))  # a full name equal to the zoo's tag
    found = plugins.load()
    assert "error" not in found["shadow_tag"] and "error" not in found["shadow_full"]
    own = get_model("zoo-tiny-moe")
    assert own.name == "mixtral.zoo-tiny-moe" and own.hub_id is None
    assert resolve_path("zoo-tiny-moe") == own.local_path
    assert get_model("evil.zoo-tiny-moe").hub_id == "org/evil.zoo-tiny-moe"  # the full name still works


def test_model_short_name_ambiguous_among_third_party(plugins):
    plugins.add("fam_a", MODEL.format(name="afam.shared-tag"))
    plugins.add("fam_b", MODEL.format(name="bfam.shared-tag"))
    plugins.load()
    with pytest.raises(KeyError) as err:
        get_model("shared-tag")
    msg = err.value.args[0]
    assert msg == ("model name 'shared-tag' is ambiguous: it fits afam.shared-tag (fam-a), "
                   "bfam.shared-tag (fam-b); use the full name")
    with pytest.raises(KeyError, match="ambiguous"):
        resolve_path("shared-tag")
    assert get_model("bfam.shared-tag").hub_id == "org/bfam.shared-tag"
    with pytest.raises(KeyError) as err:
        get_model("shared-tagg")
    assert err.value.args[0].count("'shared-tag'") == 1  # suggested once, not once per entry


def test_unknown_name_in_env_var_is_warned(plugins, monkeypatch):
    plugins.add("wanted", ROUTER.format(name="wanted-router"), dist="Wanted_Dist")
    plugins.add("unwanted", ROUTER.format(name="unwanted-router"))
    monkeypatch.setenv("MOE_ZOO_LOAD_PLUGINS", "wanted-dist, no-such-plugin")
    with pytest.warns(UserWarning) as caught:
        found = plugins.load()
    assert [str(w.message) for w in caught] == [
        "MOE_ZOO_LOAD_PLUGINS: no installed plugin is named 'no-such-plugin'; "
        "installed entry points: unwanted, wanted"]
    assert "wanted" in found and "unwanted" not in found  # the distribution name matches however it is spelt


def test_an_entry_point_named_like_a_taken_plugin_is_refused(plugins):
    plugins.add("impostor", ROUTER.format(name="impostor-router"), dist="impostor-dist", ep="zoo_routers")
    plugins.add("example_a", ROUTER.format(name="a-router"), dist="dist-a", ep="example")
    plugins.add("example_b", ROUTER.format(name="b-router"), dist="dist-b", ep="example")
    found = plugins.load()
    assert found["impostor-dist:zoo_routers"]["error"] == (
        "entry point 'zoo_routers' is already the name of a plugin of moe-zoo; not loaded")
    assert P.pm.get_plugin("zoo_routers").__name__ == "zoo_routers"
    assert found["example"]["components"] == ["router:a-router"]
    assert found["dist-b:example"]["error"] == (
        "entry point 'example' is already the name of a plugin of dist-a; not loaded")
    assert "impostor-router" not in P.registry.by_kind["router"] and "b-router" not in P.registry.by_kind["router"]


def test_plugin_output_goes_to_stderr(plugins, capsys):
    plugins.add("chatty", 'print("hello from a plugin")\n' + ROUTER.format(name="chatty-router"))
    plugins.load()
    out, err = capsys.readouterr()
    assert out == "" and "hello from a plugin" in err  # stdout stays clean for `moe-zoo plugins` JSON


def _subprocess(tmp_path, plugins: dict, args):
    """Run python with fake installed distributions (dist-info + entry point) for ``plugins`` in tmp_path."""
    for module, source in plugins.items():
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        info = tmp_path / f"{module}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[moe_zoo]\n{module} = {module}\n")
    env = {k: v for k, v in os.environ.items() if k != "MOE_ZOO_LOAD_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), os.path.dirname(os.path.dirname(zoo.__file__))])
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300)


ATTACKERS = {
    "exit_import": "import sys\nsys.exit('plugin quit at import')\n",
    "exit_hook": "import zoo\n@zoo.hookimpl\ndef register_routers(register):\n    raise SystemExit(2)\n",
    "clash_cmd": COMMAND.format(names=["plugins"], module="clash_cmd"),
}


def test_moe_zoo_plugins_survives_exiting_plugins(tmp_path):
    res = _subprocess(tmp_path, ATTACKERS, ["-m", "zoo.cli", "plugins"])
    assert res.returncode == 0, res.stderr[-2000:]
    errors = {row["name"]: row.get("error") for row in json.loads(res.stdout)}  # `plugins` is still the built-in
    assert errors == {
        "exit_import": "import: SystemExit: plugin quit at import",
        "exit_hook": "register_routers: SystemExit: 2",
        "clash_cmd": "register_commands: command 'plugins' would replace the built-in `moe-zoo plugins`; not added",
    }


def test_a_plugin_imported_before_zoo_still_registers(tmp_path):
    """``import late`` imports zoo, which loads plugins while ``late`` is mid-import: its hooks must be
    registered on the next load, not lost. ``import zoo`` survives the exiting plugins too."""
    code = ("import late\nimport zoo\n"
            "print(sorted(c['name'] for c in zoo.list_components('router')), sorted(zoo.components.plugins.errors))")
    res = _subprocess(tmp_path, {"late": ROUTER.format(name="late-router"), **ATTACKERS}, ["-c", code])
    assert res.returncode == 0, res.stderr[-2000:]
    assert "'late-router'" in res.stdout and "'topk-softmax'" in res.stdout, res.stdout
    assert res.stdout.rstrip().endswith("['exit_hook', 'exit_import']"), res.stdout  # not 'late'


def test_a_misspelt_hook_is_reported_with_the_right_name(plugins):
    plugins.add("typo_hook", """
        import zoo
        @zoo.hookimpl
        def register_compresors(register):
            pass
        """)
    plugins.add("good_one", ROUTER.format(name="good-router"))
    found = plugins.load()
    assert one_line(found["typo_hook"]["error"]).startswith(
        "unknown hook 'register_compresors' is never called; did you mean 'register_compressors'")
    assert found["good_one"]["components"] == ["router:good-router"] and "error" not in found["good_one"]
