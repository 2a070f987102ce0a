"""Startup: ``import zoo`` and ``moe-zoo --help`` import neither torch nor transformers' config/model machinery;
everything heavy happens on first use, and first use still works: the zoo_<family> model types (plugin
architectures' included) load through transformers' Auto classes whichever of zoo and transformers is imported
first. Each check runs in a fresh process (no timings here: benchmarks/startup.py measures them)."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers.configuration_utils", "transformers.modeling_utils")


def python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "GRADIO_ANALYTICS_ENABLED": "False",
           "TQDM_DISABLE": "1"}
    env.pop("MOE_ZOO_LOAD_PLUGINS", None)
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def last_json(run: subprocess.CompletedProcess):
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_import_zoo_imports_nothing_heavy():
    found = last_json(python(f"""
        import json, sys
        import zoo
        names = dir(zoo)
        hookimpl = zoo.hookimpl  # pluggy only
        import zoo.components.plugins
        print(json.dumps({{"heavy": [m for m in {HEAVY!r} if m in sys.modules],
                          "plugins_loaded": zoo.components.plugins._loaded, "all": zoo.__all__,
                          "missing_from_dir": [n for n in zoo.__all__ if n not in names]}}))
    """))
    assert found["heavy"] == [] and not found["plugins_loaded"]
    assert found["missing_from_dir"] == [] and {"Router", "apply", "hookimpl", "load_tokenizer"} <= set(found["all"])


def test_public_names_and_submodules_resolve_after_a_bare_import():
    found = last_json(python("""
        import json, types
        import zoo
        corpus = zoo.editing.calibration.corpus  # a submodule, as the README uses it
        from zoo import Router  # what a plugin module does
        import zoo.editing.apply, zoo.convert  # the submodules of the same names do not replace the functions
        names = {n: getattr(zoo, n) for n in zoo.__all__}
        print(json.dumps({"corpus": callable(corpus), "router": Router is zoo.moe.Router,
                          "functions": [n for n in ("apply", "convert", "export", "load", "card", "list_components")
                                        if callable(names[n]) and not isinstance(names[n], types.ModuleType)],
                          "moe": isinstance(zoo.moe, types.ModuleType)}))
    """))
    assert found == {"corpus": True, "router": True, "moe": True,
                     "functions": ["apply", "convert", "export", "load", "card", "list_components"]}


def test_plugins_load_at_the_first_registry_lookup():
    found = last_json(python("""
        import json
        import zoo
        names = {c["name"] for c in zoo.list_components()}
        print(json.dumps([n in names for n in ("topk-softmax", "hierarchical-modality", "mixtral", "zoo_mm")]))
    """))
    assert found == [True, True, True, True]


def test_help_lists_plugin_commands_without_importing_torch():
    found = last_json(python(f"""
        import contextlib, io, json, sys
        from zoo.cli import main
        sys.argv = ["moe-zoo", "--help"]
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main()
        print(json.dumps({{"help": out.getvalue(), "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
    """))
    assert "digits-mm" in found["help"] and "components" in found["help"]
    assert found["heavy"] == []


def test_console_script_help_and_version():
    script = Path(sys.executable).with_name("moe-zoo")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "zoo.cli"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([*cmd, "--help"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0 and "digits-mm" in run.stdout, run.stderr[-2000:]
    version = subprocess.run([*cmd, "--version"], capture_output=True, text=True, env=env, timeout=300)
    assert version.returncode == 0 and "version" in version.stdout


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny saved zoo_mixtral model and a tiny saved zoo_mm model (the multimodal plugin's architecture)."""
    import zoo
    from zoo.testing import tiny_model

    folder = tmp_path_factory.mktemp("startup")
    zoo.convert(tiny_model("mixtral")).save_pretrained(folder / "mixtral")
    tiny_model("zoo_mm").save_pretrained(folder / "zoo_mm")
    return folder


LOAD = """
    import json
    {imports}
    from transformers import AutoConfig
    configs = [type(AutoConfig.from_pretrained(f)).__name__ for f in {folders!r}]
    models = [type(AutoModelForCausalLM.from_pretrained(f)).__name__ for f in {folders!r}]
    print(json.dumps({{"configs": configs, "models": models}}))
"""


@pytest.mark.parametrize("imports", ["import zoo\nfrom transformers import AutoModelForCausalLM",
                                     "from transformers import AutoModelForCausalLM\nimport zoo"],
                         ids=["zoo-first", "transformers-first"])
def test_auto_classes_load_zoo_models_in_either_import_order(saved, imports):
    folders = [str(saved / "mixtral"), str(saved / "zoo_mm")]
    found = last_json(python(LOAD.format(imports=imports.replace("\n", "\n    "), folders=folders)))
    assert found == {"configs": ["ZooMixtralConfig", "ZooMMConfig"],
                     "models": ["ZooMixtralForCausalLM", "ZooMMForCausalLM"]}


def test_auto_config_alone_after_import_zoo(saved):
    found = last_json(python(f"""
        import json
        import zoo
        from transformers import AutoConfig
        print(json.dumps(type(AutoConfig.from_pretrained({str(saved / "mixtral")!r})).__name__))
    """))
    assert found == "ZooMixtralConfig"


@pytest.mark.parametrize("order", ["zoo-first", "transformers-first"])
def test_auto_processor_finds_a_plugin_processor_after_import_zoo(order):
    """AutoProcessor looks a processor up by the class name in its folder, with no model-type lookup: the zoo's
    lazy registration must answer that lookup too (zoo-tiny-mm's processor, not a bare tokenizer)."""
    imports = ["import zoo", "from transformers import AutoProcessor"]
    found = last_json(python(f"""
        import json
        {(imports if order == "zoo-first" else imports[::-1])[0]}
        {(imports if order == "zoo-first" else imports[::-1])[1]}
        from zoo.components.registry import get_model
        path = get_model("zoo-tiny-mm").local_path
        print(json.dumps(type(AutoProcessor.from_pretrained(path)).__name__))
    """))
    assert found == "ZooMMProcessor"


def test_generate_says_it_compiles(monkeypatch):
    """The first compiled call takes a while: ``moe-zoo generate`` says so on stderr first (not with --no-compile)."""
    from click.testing import CliRunner

    import zoo.runtime.decode
    from zoo.cli import cli

    calls = []

    def fake_greedy(lm, ids, max_new_tokens, compile, **kwargs):
        calls.append(compile)
        return {"tokens": ids, "decode_tok_s": 1.0, "first_token_s": 0.1, "warmup_s": 0.0}

    monkeypatch.setattr(zoo.runtime.decode, "timed_greedy", fake_greedy)
    args = ["generate", "zoo-tiny-moe", "def add(a, b):", "--max-new-tokens", "2", "--threads", "1"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    assert "compiling the decode step" in res.stderr and "compiling" not in res.stdout
    res = CliRunner().invoke(cli, [*args, "--no-compile"])
    assert res.exit_code == 0 and "compiling the decode step" not in res.stderr
    assert calls == [True, False]


PLUGIN = '''
import zoo

class ToyArchitecture:
    name = "toy_native"
    summary = "a plugin architecture that registers a native model type of its own"

    def register_auto_classes(self):
        from transformers import AutoConfig, PretrainedConfig

        class ToyNativeConfig(PretrainedConfig):
            model_type = "toy_native"

        AutoConfig.register("toy_native", ToyNativeConfig)

@zoo.hookimpl
def register_architectures(register):
    register(ToyArchitecture())
'''


def test_a_plugin_architectures_native_type_loads_after_a_bare_import(tmp_path):
    """A model type transformers does not ship, registered by a plugin architecture, loads too: transformers' first
    lookup of it loads the plugins."""
    (tmp_path / "toy_plugin.py").write_text(PLUGIN)
    info = tmp_path / "toy_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[moe_zoo]\ntoy_plugin = toy_plugin\n")
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "config.json").write_text(json.dumps({"model_type": "toy_native"}))
    found = last_json(python(f"""
        import json, sys
        sys.path.insert(0, {str(tmp_path)!r})
        import zoo
        from transformers import AutoConfig
        print(json.dumps(type(AutoConfig.from_pretrained({str(tmp_path / "saved")!r})).__name__))
    """))
    assert found == "ToyNativeConfig"
