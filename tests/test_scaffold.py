"""``moe-zoo plugin new``: a plugin of every kind is scaffolded, pip-installed (offline, no build isolation) into a
throwaway venv that sees the installed zoo, and then works there: its own generated tests pass, ``moe-zoo plugins``
lists it without error, and ``moe-zoo demo`` finds its Space. Mistakes are refused in one line, writing nothing."""
import json
import sysconfig

import pytest
from click.testing import CliRunner

from throwaway_venv import make_venv, run
from zoo.cli import cli

KINDS = ("router", "compressor", "adapter", "experts", "architecture")


def new(*args):
    return CliRunner().invoke(cli, ["plugin", "new", *args])


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv python, folder holding moe-zoo-demo-<kind>/ for every kind), all installed in one pip run."""
    root = tmp_path_factory.mktemp("scaffold")
    python = make_venv(root / "venv")
    for kind in KINDS:
        result = new(f"demo-{kind}", "--kind", kind, "--dir", str(root / "plugins"))
        assert result.exit_code == 0, result.output
    pip = run(python, "-m", "pip", "install", "--no-index", "--no-build-isolation",
              *[str(root / "plugins" / f"moe-zoo-demo-{kind}") for kind in KINDS])
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    return python, root / "plugins"


def test_writes_a_complete_package(tmp_path):
    result = new("my-router", "--kind", "router", "--dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    pkg = tmp_path / "moe-zoo-my-router"
    files = sorted(str(p.relative_to(pkg)) for p in pkg.rglob("*") if p.is_file())
    assert files == ["README.md", "moe_zoo_my_router/__init__.py", "moe_zoo_my_router/cards/my-router.md",
                     "moe_zoo_my_router/router.py", "moe_zoo_my_router/spaces/my-router/README.md",
                     "moe_zoo_my_router/spaces/my-router/app.py", "moe_zoo_my_router/spaces/my-router/requirements.txt",
                     "pyproject.toml", "tests/test_my_router.py"]
    pyproject = (pkg / "pyproject.toml").read_text()
    assert 'name = "moe-zoo-my-router"' in pyproject and '"moe-zoo>=' in pyproject
    assert '[project.entry-points.moe_zoo]\nmy-router = "moe_zoo_my_router"' in pyproject
    assert "class MyRouter(zoo.Router)" in (pkg / "moe_zoo_my_router/router.py").read_text()
    assert "uses_context" in (pkg / "moe_zoo_my_router/router.py").read_text()
    assert "$" not in "".join(p.read_text() for p in pkg.rglob("*") if p.is_file())  # every placeholder filled


def test_pip_sees_the_installed_zoo(installed):
    python, _ = installed
    show = run(python, "-m", "pip", "show", "moe-zoo", "moe-zoo-demo-router")
    assert show.returncode == 0, show.stderr
    zoo_info, plugin_info = show.stdout.split("\n---\n")
    assert "Name: moe-zoo\n" in zoo_info and f"Location: {sysconfig.get_path('purelib')}\n" in zoo_info  # ours
    assert "Requires: moe-zoo" in plugin_info and "venv" in plugin_info.split("Location: ")[1].splitlines()[0]


def test_generated_tests_pass_in_the_venv(installed):
    python, plugins = installed
    folders = [str(plugins / f"moe-zoo-demo-{kind}" / "tests") for kind in KINDS]
    result = run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::UserWarning", *folders,
                 cwd=plugins)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-1000:]


def test_moe_zoo_plugins_lists_them_and_demo_finds_their_spaces(installed):
    python, plugins = installed
    listed = run(python, "-m", "zoo.cli", "plugins")
    assert listed.returncode == 0, listed.stderr[-3000:]
    rows = {row["name"]: row for row in json.loads(listed.stdout)}
    for kind in KINDS:
        row = rows[f"demo-{kind}"]
        assert "error" not in row, row
        assert row["distribution"] == f"moe-zoo-demo-{kind}" and row["version"] == "0.1.0"
        component = "demo_architecture" if kind == "architecture" else f"demo-{kind}"
        assert row["components"] == [f"{kind}:{component}"]
    demo = run(python, "-m", "zoo.cli", "demo", "demo-routr")
    assert demo.returncode == 1 and "did you mean 'demo-router'" in demo.stderr, demo.stderr[-2000:]


@pytest.mark.parametrize("name, message", [
    ("My_Router", "must be lowercase words joined by dashes"),
    ("1router", "must be lowercase words joined by dashes"),
    ("my--router", "must be lowercase words joined by dashes"),
    ("moe-zoo-x", "leave out the 'moe-zoo-' prefix"),
])
def test_bad_names_are_refused(tmp_path, name, message):
    result = new(name, "--kind", "router", "--dir", str(tmp_path))
    assert result.exit_code == 2 and message in result.output
    assert result.output.strip().splitlines()[-1].startswith("Error: ")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name, kind, message", [
    ("top-p", "router", "router 'top-p' is already registered by moe-zoo"),
    ("qwen3-moe", "architecture", "architecture 'qwen3_moe' is already registered by moe-zoo"),
    ("llama", "architecture", "'llama' is a transformers model type already"),
])
def test_taken_names_are_refused(tmp_path, name, kind, message):
    result = new(name, "--kind", kind, "--dir", str(tmp_path))
    assert result.exit_code == 2 and message in result.output, result.output
    assert list(tmp_path.iterdir()) == []


def test_unknown_kind_gets_a_suggestion(tmp_path):
    result = new("x", "--kind", "routr", "--dir", str(tmp_path))
    assert result.exit_code == 2 and "unknown kind 'routr'; did you mean 'router'?" in result.output
    assert list(tmp_path.iterdir()) == []


def test_an_existing_folder_with_files_is_refused(tmp_path):
    (tmp_path / "moe-zoo-x").mkdir()
    (tmp_path / "moe-zoo-x" / "keep.txt").write_text("mine")
    result = new("x", "--kind", "router", "--dir", str(tmp_path))
    assert result.exit_code == 2 and "exists and is not empty" in result.output
    assert [p.name for p in (tmp_path / "moe-zoo-x").iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["moe-zoo-x"]  # no staging folder left behind


def test_an_empty_folder_is_filled_and_a_file_dir_refused(tmp_path):
    (tmp_path / "moe-zoo-x").mkdir()
    assert new("x", "--kind", "compressor", "--dir", str(tmp_path)).exit_code == 0
    assert (tmp_path / "moe-zoo-x" / "moe_zoo_x" / "compressor.py").is_file()
    (tmp_path / "file").write_text("")
    result = new("y", "--kind", "router", "--dir", str(tmp_path / "file"))
    assert result.exit_code == 2 and "is a file" in result.output
