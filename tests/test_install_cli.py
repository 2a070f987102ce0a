"""``moe-zoo install``: pip with torch and the zoo's libraries pinned to their installed versions, then a load check
in a fresh process that prints one line per new plugin. Run offline in a throwaway venv that sees the zoo."""
import importlib.metadata as md
import shutil
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from throwaway_venv import make_venv, run
from zoo.cli import cli
from zoo.components.install import constraints_text, pinned

EXAMPLE = Path(__file__).parent / "plugin_example"
OFFLINE = ("--no-index", "--no-build-isolation")


def package(root: Path, dist: str, source: str, entry_point: bool = True, dependencies=("moe-zoo",)) -> Path:
    """A minimal installable package ``root/<dist>`` with one module (and a ``moe_zoo`` entry point)."""
    module = dist.replace("-", "_")
    folder = root / dist
    folder.mkdir(parents=True)
    (folder / f"{module}.py").write_text(textwrap.dedent(source))
    deps = ", ".join(f'"{d}"' for d in dependencies)
    entry = f'[project.entry-points.moe_zoo]\n{dist} = "{module}"\n' if entry_point else ""
    (folder / "pyproject.toml").write_text(
        f'[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n\n'
        f'[project]\nname = "{dist}"\nversion = "1.0"\ndependencies = [{deps}]\n\n{entry}\n'
        f'[tool.setuptools]\npy-modules = ["{module}"]\n')
    return folder


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    root = tmp_path_factory.mktemp("install")
    return make_venv(root / "venv"), root


def install(python, *args):
    return run(python, "-m", "zoo.cli", "install", *OFFLINE, *args)


def test_pins_torch_and_the_zoos_libraries_to_what_is_installed():
    pins = pinned()
    assert pins["torch"] == md.version("torch") and pins["moe-zoo"] == md.version("moe-zoo")
    for name in ("transformers", "huggingface-hub", "safetensors", "numpy"):
        assert pins[name] == md.version(name)
    assert "pytest" not in pins and "selenium" not in pins  # the test extra is not the zoo's core
    assert f"torch=={md.version('torch')}\n" in constraints_text(pins)


def test_installs_the_example_plugin_and_reports_its_components(venv):
    python, root = venv
    source = shutil.copytree(EXAMPLE, root / "plugin_example", ignore=shutil.ignore_patterns("build", "*.egg-info"))
    result = install(python, str(source))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "example 0.3.0 (moe-zoo-example-plugin): router:example-switch-top1" in result.stdout.splitlines()


def test_editable_install_of_a_scaffolded_plugin(venv):
    python, root = venv
    assert CliRunner().invoke(cli, ["plugin", "new", "my-router", "--kind", "router", "--dir", str(root)]).exit_code == 0
    result = install(python, "-e", str(root / "moe-zoo-my-router"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "my-router 0.1.0 (moe-zoo-my-router): router:my-router" in result.stdout.splitlines()
    located = run(python, "-c", "import moe_zoo_my_router; print(moe_zoo_my_router.__file__)")
    assert located.stdout.strip() == str(root / "moe-zoo-my-router" / "moe_zoo_my_router" / "__init__.py")


def test_a_broken_plugin_and_a_non_plugin_are_reported(venv):
    python, root = venv
    broken = package(root, "moe-zoo-broken", "raise RuntimeError('boom at import')\n")
    plain = package(root, "plain-lib", "VALUE = 1\n", entry_point=False, dependencies=())
    result = install(python, str(broken), str(plain))
    lines = result.stdout.splitlines()
    assert result.returncode == 1
    assert "moe-zoo-broken 1.0 (moe-zoo-broken): error: import: RuntimeError: boom at import" in lines
    assert "plain-lib 1.0: installed, but it has no moe_zoo entry point (not a moe-zoo plugin)" in lines
    assert result.stderr.strip().splitlines()[-1] == \
        "Error: installed, but 1 plugin(s) failed to load: moe-zoo-broken"


def test_a_plugin_that_wants_another_torch_is_refused_and_torch_stays(venv):
    python, root = venv
    greedy = package(root, "moe-zoo-greedy", "", dependencies=("moe-zoo", "torch==1.13.0"))
    result = install(python, str(greedy))
    assert result.returncode == 1
    said = result.stdout + result.stderr
    constraint = next((ln for ln in said.splitlines() if "The user requested (constraint) torch" in ln), "")
    assert f"=={md.version('torch')}" in constraint and "depends on torch==1.13.0" in said, said[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith("Error: pip install failed (exit status 1)")
    check = run(python, "-c", "import torch, importlib.metadata as md; print(torch.__version__, "
                              "[d.metadata['Name'] for d in md.distributions() if d.metadata['Name'] == 'moe-zoo-greedy'])")
    assert check.stdout.split() == [md.version("torch"), "[]"]


def test_nothing_to_install_is_a_usage_error():
    result = CliRunner().invoke(cli, ["install"])
    assert result.exit_code == 2 and "name at least one package to install" in result.output
