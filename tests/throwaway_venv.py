"""A throwaway venv for installing plugins in tests: it sees the zoo and its libraries (torch, transformers, pip,
setuptools, pytest, ...) through a ``.pth`` file in its own site-packages that adds the running interpreter's, so
nothing is copied or downloaded, and whatever is installed into it never reaches the project's own environment."""
from __future__ import annotations

import os
import subprocess
import sysconfig
import venv
from pathlib import Path


def make_venv(path: Path) -> Path:
    """Create the venv at ``path``; returns its python."""
    venv.create(path, with_pip=False, symlinks=True)  # pip too comes from the zoo's environment
    scheme = {"base": str(path), "platbase": str(path)}
    own = Path(sysconfig.get_path("purelib", vars=scheme))
    own.mkdir(parents=True, exist_ok=True)
    # addsitedir (not a bare path line) also runs the zoo environment's own .pth files: its editable install
    lines = [f"import site; site.addsitedir({p!r})\n" for p in
             dict.fromkeys((sysconfig.get_path("purelib"), sysconfig.get_path("platlib")))]
    (own / "moe_zoo_environment.pth").write_text("".join(lines))
    return path / "bin" / "python"


def run(python: Path, *args: str, cwd=None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python args...`` offline, with every installed plugin selected and no inherited PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("MOE_ZOO_LOAD_PLUGINS", "PYTHONPATH")}
    env.update(HF_HUB_OFFLINE="1", PIP_NO_INDEX="1", PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return subprocess.run([str(python), *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)
