"""``moe-zoo install``: pip-install plugins into the running interpreter without ever changing torch or the
libraries the zoo is built on, then load every plugin in a fresh process and report the new ones.

pip gets a constraints file that pins, to their *installed* versions, the zoo itself, torch, every library the
zoo depends on directly, and numpy (torch and scipy are built against its ABI): a plugin that needs another
version of one of them makes pip stop with a resolution error instead of replacing it (so pip can never pull a
new or CUDA torch).
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

OWN = "moe-zoo"
EXTRA_PINS = ("torch", "numpy")


class InstallError(RuntimeError):
    """pip failed, or the load check could not run; the message is one line."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned() -> dict[str, str]:
    """``{distribution: installed version}`` of the zoo, its direct requirements and torch/numpy."""
    from packaging.requirements import Requirement

    names = [OWN, *EXTRA_PINS]
    try:
        requires = md.requires(OWN) or []
    except md.PackageNotFoundError:  # the zoo imported from a checkout that was never installed
        requires = []
    for line in requires:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):  # the optional extras are not pinned
            names.append(req.name)
    pins = {}
    for name in names:
        try:
            pins[canonical(name)] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return pins


def constraints_text(pins: dict[str, str]) -> str:
    return "".join(f"{name}=={version}\n" for name, version in sorted(pins.items()))


def pip_command(packages, constraints: Path, report: Path, editable=(), flags=()) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "install", "--constraint", str(constraints), "--report", str(report)]
    for path in editable:
        cmd += ["--editable", str(path)]
    return cmd + list(flags) + list(packages)


def check_pip() -> None:
    """pip 22.2 or newer (``--report`` says what it installed)."""
    from packaging.version import Version

    try:
        version = md.version("pip")
    except md.PackageNotFoundError:
        raise InstallError(f"pip is not installed for {sys.executable}: python -m ensurepip --upgrade") from None
    if Version(version) < Version("22.2"):
        raise InstallError(f"moe-zoo install needs pip 22.2 or newer, this is pip {version}: "
                           "python -m pip install -U pip")


def run_pip(packages, editable=(), flags=()) -> list[dict]:
    """Run pip (its output goes to the terminal); return its report's ``install`` list (what it installed)."""
    check_pip()
    with tempfile.TemporaryDirectory(prefix="moe-zoo-install-") as tmp:
        constraints, report = Path(tmp) / "constraints.txt", Path(tmp) / "report.json"
        pins = pinned()
        constraints.write_text(constraints_text(pins))
        rc = subprocess.call(pip_command(packages, constraints, report, editable, flags))
        if rc != 0:
            shown = ", ".join(f"{n}=={v}" for n, v in sorted(pins.items()) if n in (OWN, *EXTRA_PINS))
            raise InstallError(f"pip install failed (exit status {rc}); the zoo's libraries were held at their "
                               f"installed versions ({shown}, and the zoo's other requirements)")
        if not report.is_file():  # --dry-run, or a pip that writes no report
            return []
        return json.loads(report.read_text()).get("install", [])


LOAD_CHECK = "import json, zoo.components.plugins; print(json.dumps(zoo.components.plugins.plugin_report()))"


def load_check() -> list[dict]:
    """``plugin_report()`` of a fresh interpreter in which every installed plugin loads (the environment's
    ``MOE_ZOO_LOAD_PLUGINS`` is left out, so a plugin it would not select is still checked)."""
    env = {k: v for k, v in os.environ.items() if k != "MOE_ZOO_LOAD_PLUGINS"}
    run = subprocess.run([sys.executable, "-c", LOAD_CHECK], capture_output=True, text=True, env=env)
    lines = run.stdout.strip().splitlines()
    if run.returncode != 0 or not lines:
        last = (run.stderr.strip().splitlines() or ["no output"])[-1]
        raise InstallError(f"the load check (`import zoo`) failed in a fresh process: {last}")
    return json.loads(lines[-1])


def describe(row: dict) -> str:
    """One line for a plugin: its components, or its error."""
    head = f"{row['name']} {row['version']} ({row['distribution']})"
    if "error" in row:
        return f"{head}: error: {row['error']}"
    return f"{head}: {', '.join(row['components']) or 'no components'}"


def new_plugins(installed: list[dict], report: list[dict]) -> tuple[list[dict], list[str]]:
    """The report rows of the plugins pip just installed, and the requested distributions that are no plugin."""
    names = {canonical(item["metadata"]["name"]): item for item in installed}
    rows = [row for row in report if canonical(row["distribution"]) in names]
    plugin_dists = {canonical(row["distribution"]) for row in rows}
    not_plugins = [f"{item['metadata']['name']} {item['metadata']['version']}" for name, item in names.items()
                   if item.get("requested") and name not in plugin_dists]
    return rows, not_plugins


def selected(row: dict) -> bool:
    """Whether ``MOE_ZOO_LOAD_PLUGINS`` (as set in this environment) lets the plugin load."""
    wanted = os.environ.get("MOE_ZOO_LOAD_PLUGINS")
    if wanted is None:
        return True
    names = {w.strip() for w in wanted.split(",") if w.strip()}
    return row["name"] in names or canonical(row["distribution"]) in {canonical(n) for n in names}
