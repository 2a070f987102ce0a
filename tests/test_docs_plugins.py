"""docs/plugins/ is executed: every ```python block of every page runs, in order, one namespace per page, and the
asserts the examples end with must hold.

How a page is run (the conventions the pages follow):
- A fenced block whose first line is ``# file: PATH`` (or ``{# file: PATH #}`` in a Jinja card template), or whose
  info string holds ``file=PATH`` (a README with front matter), is a file of the page's plugin project: it is not
  run but written (appended, when several blocks name one file, in page order) under a fresh project folder, all
  of them before the page's code runs. Python files run when the zoo imports them (the plugin loader, a Space's
  loader); each must be imported by the end of the page.
- A project with a ``pyproject.toml`` is installed as ``pip install -e .`` would install it, before the page's first
  python block runs: a ``<name>-<version>.dist-info`` with its ``moe_zoo`` entry points is written into the project
  folder, and that folder is put on ``sys.path`` and ``PYTHONPATH`` (fresh processes find it too); then
  ``zoo.components.plugins.load_new_plugins()`` loads it, as ``import zoo`` in a fresh process would.
- Every other python block runs in the page's namespace, with the page's temporary folder as working directory.
After each page everything it registered is taken out again: registry entries, pluggy plugins, plugin errors and
bookkeeping, CLI commands, transformers Auto-class registrations, imported modules of its project, sys.path.

The meta tests check that every hookspec has a heading and an example in which a real plugin registration called
it, that every base class has its page, that every ``zoo.x.y`` name the pages mention resolves, and the links.
"""
from __future__ import annotations

import ast
import importlib
import os
import re
import sys
import tempfile
import tomllib
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import zoo
import zoo.components.plugins as P
from zoo import hookspecs

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "plugins"
PAGES = sorted(p.name for p in DOCS.glob("*.md"))

# base class -> (its page, the dotted name the page's title gives it)
BASES = {
    "Router": ("router.md", "zoo.Router"),
    "Experts": ("experts.md", "zoo.Experts"),
    "Compressor": ("compressor.md", "zoo.Compressor"),
    "Adapter": ("adapter.md", "zoo.Adapter"),
    "Family": ("architecture.md", "zoo.architectures.family.Family"),
    "ModelEntry": ("models-and-commands.md", "zoo.components.registry.ModelEntry"),
}
HOOKS = sorted(n for n in dir(hookspecs) if getattr(getattr(hookspecs, n), "moe_zoo_spec", None) is not None)

# Blocks that document a contract the core does not keep yet: (page, a line of the block) -> reason. Such a block
# runs and must fail (the page goes on); once it passes, its test fails so that the entry gets removed.

FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=fence)[ \t]*$", re.M | re.S)
MARKER = re.compile(r"^(?:#|\{#)\s*file:\s*(?P<path>[^\s#]+)\s*(?:#\})?\s*$")


@dataclass
class Block:
    lang: str
    body: str
    line: int  # line of the page on which the body starts
    path: str | None  # a project file, or None for code to run


def blocks(page: str) -> list[Block]:
    text = (DOCS / page).read_text()
    out = []
    for m in FENCE.finditer(text):
        info = m["info"].strip()
        lang = info.split()[0].lower() if info else ""
        body = m["body"]
        first = body.split("\n", 1)[0]
        marker = MARKER.match(first)
        named = re.search(r"\bfile=(\S+)", info)  # where a first-line comment cannot go (front matter)
        path = marker["path"] if marker else named.group(1) if named else None
        out.append(Block(lang, body, text.count("\n", 0, m.start("body")) + 1, path))
    return out


# ---- the sandbox a page runs in -------------------------------------------------------------------------------

def _auto_mappings():
    """Every transformers Auto mapping a registration can add to (their ``_extra_content`` dicts)."""
    from transformers.models.auto import configuration_auto, modeling_auto

    maps = [configuration_auto.CONFIG_MAPPING]
    maps += [v for v in vars(modeling_auto).values() if hasattr(v, "_extra_content") and v is not None]
    return [m for m in maps if isinstance(getattr(m, "_extra_content", None), dict)]


@contextmanager
def sandbox(folder: Path):
    """Restore every piece of global state a page may change (see the module docstring); the plugin loader's and
    the registry's through ``zoo.components.plugins.restored_state``."""
    from zoo.architectures import factory
    from zoo.cli import cli

    P.load_plugins()  # the zoo's own model types join the Auto classes first (lazily), so the snapshot keeps them
    dicts = [(m._extra_content, dict(m._extra_content)) for m in _auto_mappings()]
    commands = dict(cli.commands)
    added = cli.__dict__.get("_zoo_plugin_commands")
    added_before = None if added is None else {k: list(v) for k, v in added.items()}
    modules, path, cwd = set(sys.modules), list(sys.path), os.getcwd()
    env = {k: os.environ.get(k) for k in ("PYTHONPATH", "MOE_ZOO_LOAD_PLUGINS", "MOE_ZOO_MODEL")}
    os.environ.pop("MOE_ZOO_LOAD_PLUGINS", None)
    os.chdir(folder)
    try:
        with P.restored_state(), factory.restored_classes():
            yield
    finally:
        os.chdir(cwd)
        for k, v in env.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            file = getattr(sys.modules[name], "__file__", None) or ""
            if name.startswith("zoo_space_") or file.startswith(str(folder)):
                del sys.modules[name]
        for d, saved in dicts:
            d.clear()
            d.update(saved)
        cli.commands.clear()
        cli.commands.update(commands)
        if added_before is None:
            cli.__dict__.pop("_zoo_plugin_commands", None)
        else:
            cli.__dict__["_zoo_plugin_commands"] = added_before
        importlib.invalidate_caches()


def install(project: Path) -> dict[str, str]:
    """What ``pip install -e PROJECT`` leaves behind, for the entry points of its pyproject.toml; returns them
    (plugin name -> module)."""
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    name, version = meta["name"], meta["version"]
    eps = meta.get("entry-points", {}).get("moe_zoo", {})
    info = project / f"{re.sub(r'[-_.]+', '_', name)}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text("[moe_zoo]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))
    sys.path.insert(0, str(project))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(project), *filter(None, [os.environ.get("PYTHONPATH")])])
    importlib.invalidate_caches()
    P.load_new_plugins()  # what import zoo does in a fresh process
    return dict(eps)


@dataclass
class PageResult:
    ran: int = 0  # python blocks run (files excluded)
    files: list[Path] = field(default_factory=list)
    plugins: dict[str, str] = field(default_factory=dict)  # plugin (entry-point) name -> its module
    hooks: dict[str, set] = field(default_factory=dict)  # plugin -> hook implementations pluggy holds for it
    called: set = field(default_factory=set)  # hooks a real registration called (something registered through it)
    asserts: int = 0


def _run(block: Block, page: str, namespace: dict) -> None:
    tree = ast.parse(block.body, filename=str(DOCS / page))
    ast.increment_lineno(tree, block.line - 1)
    exec(compile(tree, str(DOCS / page), "exec"), namespace)


def _record(result: PageResult, commands_before: set) -> None:
    """What the page's plugins registered, from ``plugin_report()`` (what ``moe-zoo plugins`` prints) and the CLI."""
    from zoo.cli import cli
    from zoo.components.registry import KINDS

    rows = {row["name"]: row for row in P.plugin_report()}
    for name, module in result.plugins.items():
        row = rows.get(name)
        assert row is not None, f"plugin {name} is installed but not loaded"
        assert "error" not in row, f"plugin {name} failed to load: {row['error']}\n{row.get('traceback', '')}"
        result.hooks[name] = set(row["hooks"])
        kinds = {c.split(":", 1)[0] for c in row["components"]}
        result.called |= {hook for hook, kind in KINDS.items() if kind in kinds and hook in result.hooks[name]}
        added = [c for n, c in cli.commands.items() if n not in commands_before]
        if "register_commands" in result.hooks[name] and any(
                (getattr(c.callback, "__module__", "") or "").startswith(module) for c in added):
            result.called.add("register_commands")


_RESULTS: dict[str, PageResult] = {}


def run_page(page: str) -> PageResult:
    """Run one page (once per session; the meta tests reuse the results)."""
    if page in _RESULTS:
        return _RESULTS[page]
    result = PageResult()
    with tempfile.TemporaryDirectory(prefix="docs-plugins-") as tmp:
        folder = Path(tmp).resolve()
        project = folder / "project"
        project.mkdir()
        namespace = {"__name__": "__main__"}
        for block in blocks(page):  # the project is the sum of the page's files, whatever their order
            if block.path is not None:
                target = project / block.path
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(target, "a") as f:
                    f.write(block.body)
                result.files.append(target)
        pending = (project / "pyproject.toml").is_file()
        from zoo.cli import cli

        commands_before = set(cli.commands)
        with sandbox(folder):
            for block in blocks(page):
                if block.path is not None or block.lang != "python":
                    continue
                if pending:
                    result.plugins.update(install(project))
                    pending = False
                result.asserts += len(re.findall(r"^\s*(?:assert |with pytest\.raises)", block.body, re.M))
                _run(block, page, namespace)
                result.ran += 1
            _record(result, commands_before)
            loaded = {Path(f).resolve() for m in list(sys.modules.values())
                      if (f := getattr(m, "__file__", None))}
            unrun = [str(f.relative_to(project)) for f in dict.fromkeys(result.files)
                     if f.suffix == ".py" and f.resolve() not in loaded]
            assert not unrun, f"{page}: python files never imported (so never run): {unrun}"
    _RESULTS[page] = result
    return result


# ---- the pages ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("page", PAGES)
def test_page_runs(page, one_thread):
    result = run_page(page)
    code = [b for b in blocks(page) if b.lang == "python" and b.path is None]
    assert result.ran == len(code)
    if code:
        assert result.asserts, f"{page}: its examples assert nothing"
        assert re.search(r"^\s*(assert |with pytest\.raises)", code[-1].body, re.M), \
            f"{page}: its last example ends without asserting what it shows"


# ---- meta -----------------------------------------------------------------------------------------------------

def headings(page: str) -> list[str]:
    text = FENCE.sub("", (DOCS / page).read_text())
    return [line for line in text.splitlines() if line.startswith("#")]


def test_every_hookspec_has_a_heading_and_an_example_a_registration_called(one_thread):
    assert len(HOOKS) == 7, HOOKS
    titled = {h for page in PAGES for line in headings(page) for h in HOOKS if re.search(rf"\b{h}\b", line)}
    assert set(HOOKS) <= titled, f"hookspecs without a heading: {sorted(set(HOOKS) - titled)}"
    called = set().union(*(run_page(page).called for page in PAGES))
    assert set(HOOKS) <= called, f"hookspecs no example's plugin registration called: {sorted(set(HOOKS) - called)}"


def test_every_base_class_has_its_page():
    for cls, (page, dotted) in BASES.items():
        assert (DOCS / page).is_file(), f"{cls}: no {page}"
        title = headings(page)[0]
        assert title.startswith("# ") and f"`{dotted}`" in title, f"{page}: title {title!r} does not name {dotted}"
        assert resolve(dotted).__name__ == cls


def resolve(dotted: str):
    """``dotted`` as a reader reaches it: import its longest module prefix, then attribute access from ``zoo``."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        try:
            importlib.import_module(".".join(parts[:n]))
            break
        except ImportError:
            continue
    obj = importlib.import_module(parts[0])
    for part in parts[1:]:
        obj = getattr(obj, part)
    return obj


NAME = re.compile(r"(?<![\w.\-/])zoo(?:\.[A-Za-z_]\w*)+")


def test_every_zoo_name_the_pages_mention_resolves():
    names = sorted({m.group(0) for page in PAGES for m in NAME.finditer((DOCS / page).read_text())})
    assert len(names) > 40, names
    unresolved = []
    for name in names:
        try:
            resolve(name)
        except (ImportError, AttributeError) as exc:
            unresolved.append(f"{name} ({exc})")
    assert not unresolved, "names the pages mention that do not resolve: " + "; ".join(unresolved)


LINK = re.compile(r"\]\((?P<target>[^)#\s]*)(?:#(?P<anchor>[^)\s]*))?\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.lstrip("#").strip().lower()).replace(" ", "-")


def test_links_resolve_and_the_overview_links_every_page():
    for page in PAGES:
        for m in LINK.finditer((DOCS / page).read_text()):
            target = m["target"] or page
            if "://" in target:
                continue
            assert (DOCS / target).exists(), f"{page}: broken link {target}"
            if m["anchor"]:
                anchors = {slug(h) for h in headings(target)}
                assert m["anchor"] in anchors, f"{page}: no heading of {target} has the anchor #{m['anchor']}"
    linked = {m["target"] for m in LINK.finditer((DOCS / "README.md").read_text())}
    assert set(PAGES) - {"README.md"} <= linked, f"pages README.md does not link: {set(PAGES) - linked - {'README.md'}}"


def test_the_old_contract_page_points_to_the_new_one():
    old = (ROOT / "docs" / "plugin-contract.md").read_text().strip().splitlines()
    assert len(old) == 2 and "plugins/compressor.md" in old[1]
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("**/*.md")]:
        if doc.name != "plugin-contract.md":
            assert "plugin-contract.md" not in doc.read_text(), f"{doc} still links docs/plugin-contract.md"


def test_the_scaffold_listing_is_what_plugin_new_writes(tmp_path):
    """README.md's listing of `moe-zoo plugin new my-router --kind router`, against what the command writes."""
    from click.testing import CliRunner

    from zoo.cli import cli

    text = (DOCS / "README.md").read_text()
    listing = next(b.body for b in blocks("README.md") if b.lang == "text" and b.body.startswith("moe-zoo-my-router/"))
    listed = {line.split()[0] for line in listing.splitlines()[1:] if line.strip()}
    assert "moe-zoo plugin new my-router --kind router" in text
    result = CliRunner().invoke(cli, ["plugin", "new", "my-router", "--kind", "router", "--dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    root = tmp_path / "moe-zoo-my-router"
    written = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
    assert written == listed
    assert 'my-router = "moe_zoo_my_router"' in (root / "pyproject.toml").read_text()
    again = CliRunner().invoke(cli, ["plugin", "new", "my-router", "--kind", "router", "--dir", str(tmp_path)])
    assert again.exit_code != 0 and "not empty" in again.output
    bad = CliRunner().invoke(cli, ["plugin", "new", "moe-zoo-x", "--kind", "router", "--dir", str(tmp_path)])
    assert bad.exit_code != 0 and "moe-zoo-" in bad.output
