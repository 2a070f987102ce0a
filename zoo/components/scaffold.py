"""``moe-zoo plugin new``: write a complete, installable plugin package from the templates in
``zoo/scaffold_templates/`` (``common/`` for every kind, ``<kind>/`` for the component and its card).

Templates are ``string.Template`` files (``$name``; a literal dollar sign is ``$$``), so the Jinja of a card
template passes through untouched. Everything is rendered in memory first and written into a staging folder
that is renamed into place: a refused name or kind, or a failure half way, writes nothing.
"""
from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import string
import tempfile
from pathlib import Path

from zoo.components.options import suggest

TEMPLATES = Path(__file__).resolve().parents[1] / "scaffold_templates"
NAME = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*\Z")

# kind -> (hook, module file of the component, class-name suffix, the Space's default options)
KINDS = {
    "router": ("register_routers", "router", "Router", "top_k=2,temperature=2.0"),
    "compressor": ("register_compressors", "compressor", "Pruner", "keep=6"),
    "adapter": ("register_adapters", "adapter", "Adapter", "targets=k_proj,v_proj"),
    "experts": ("register_experts", "experts", "Experts", ""),
    "architecture": ("register_architectures", "architecture", "Family", ""),
}


class ScaffoldError(ValueError):
    """A user mistake (name, kind, target folder); the message is one line."""


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.match(name):
        raise ScaffoldError(f"plugin name {name!r} must be lowercase words joined by dashes, starting with a "
                            "letter (e.g. 'my-router')")
    if name.startswith("moe-zoo"):
        raise ScaffoldError(f"plugin name {name!r}: leave out the 'moe-zoo-' prefix, it is added to the distribution")
    return name


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ScaffoldError(f"unknown kind {kind!r}{suggest(str(kind), KINDS)} (kinds: {', '.join(KINDS)})")
    return kind


def check_free(name: str, kind: str) -> None:
    """Refuse a component name an installed plugin (or the zoo) already registers for this kind, and an
    architecture named like a transformers model type: the new plugin would be refused when it loads."""
    from zoo.components.registry import registry

    component = variables(name, kind)["component"]
    taken = registry.find(kind, component)
    if taken is not None:
        raise ScaffoldError(f"{kind} {component!r} is already registered by {taken.distribution} "
                            f"(plugin {taken.plugin}); choose another name")
    if kind == "architecture":
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        if component in CONFIG_MAPPING_NAMES:
            raise ScaffoldError(f"{component!r} is a transformers model type already; choose another name")


def target_dir(name: str, parent: str | os.PathLike = ".") -> Path:
    """``PARENT/moe-zoo-NAME``, refused if it is a file or a folder with anything in it."""
    target = Path(parent) / f"moe-zoo-{name}"
    if target.is_file() or target.is_symlink():
        raise ScaffoldError(f"{target} exists and is not a folder")
    if target.is_dir() and any(target.iterdir()):
        raise ScaffoldError(f"{target} exists and is not empty; choose another name or --dir")
    if Path(parent).exists() and not Path(parent).is_dir():
        raise ScaffoldError(f"--dir {parent} is not a folder")
    return target


def variables(name: str, kind: str) -> dict[str, str]:
    """What the templates may use (``$name``, ``$module``, ...)."""
    hook, component_module, suffix, default_options = KINDS[kind]
    words = name.split("-")
    camel = "".join(w.capitalize() for w in words)
    class_name = camel if camel.endswith(suffix) else camel + suffix  # my-router -> MyRouter, not MyRouterRouter
    component = name.replace("-", "_") if kind == "architecture" else name  # a model type: zoo_<component>
    zoo_version, gradio_version = installed("moe-zoo", "0.1.0"), installed("gradio", "6.31.0")
    v = {
        "name": name,
        "kind": kind,
        "component": component,
        "module": f"moe_zoo_{name.replace('-', '_')}",
        "component_module": component_module,
        "class_name": class_name,
        "camel": camel,
        "title": " ".join(w.capitalize() for w in words),
        "hook": hook,
        "default_options": default_options,
        "test_file": f"test_{name.replace('-', '_')}.py",
        "zoo_version": zoo_version,
        "gradio_version": gradio_version,  # the Space's sdk_version and pin: what the zoo runs with
        "registered": class_name + ("()" if kind == "architecture" else ""),  # a Family is registered as an instance
    }
    v["usage"] = string.Template((TEMPLATES / kind / "usage.md").read_text()).substitute(v).rstrip("\n")
    return v


def installed(distribution: str, default: str) -> str:
    try:
        return md.version(distribution)
    except md.PackageNotFoundError:
        return default


def output_path(template: str, v: dict[str, str]) -> str:
    """Where a template file lands in the package (its path below ``common/`` or ``<kind>/``, ``.tmpl`` cut)."""
    rel = template.removesuffix(".tmpl")
    fixed = {"component.py": f"{v['module']}/{v['component_module']}.py",
             "card.md": f"{v['module']}/cards/{v['name']}.md",
             "tests/test_plugin.py": f"tests/{v['test_file']}"}
    if rel in fixed:
        return fixed[rel]
    if rel.startswith("space/"):
        return f"{v['module']}/spaces/{v['name']}/{rel.removeprefix('space/')}"
    if rel.startswith("package/"):
        return f"{v['module']}/{rel.removeprefix('package/')}"
    return rel


def render(name: str, kind: str) -> dict[str, str]:
    """``{relative path: text}`` of the whole package; the kind's own files win over the common ones."""
    v = variables(check_name(name), check_kind(kind))
    files: dict[str, str] = {}
    for folder in ("common", kind):
        root = TEMPLATES / folder
        for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix == ".tmpl"):
            text = string.Template(path.read_text()).substitute(v)
            files[output_path(path.relative_to(root).as_posix(), v)] = text
    return files


def new_plugin(name: str, kind: str, parent: str | os.PathLike = ".") -> Path:
    """Write the plugin package ``PARENT/moe-zoo-NAME/``; returns its path. Nothing is written on error."""
    check_name(name)
    check_kind(kind)
    target = target_dir(name, parent)
    check_free(name, kind)
    files = render(name, kind)
    Path(parent).mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".moe-zoo-{name}-", dir=parent))
    try:
        for rel, text in files.items():
            path = staging / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        os.chmod(staging, 0o777 & ~_umask())
        os.replace(staging, target)  # an empty target folder is replaced in one rename
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
