"""The plugin author's and user's commands: ``moe-zoo plugin new`` (scaffold a plugin package) and
``moe-zoo install`` (pip-install plugins without touching torch, then check that they load).

Kept apart from ``zoo.cli`` (which adds them with ``add_commands``); nothing heavy is imported until a command runs.
"""
from __future__ import annotations

import click

KIND_NAMES = ("router", "compressor", "adapter", "experts", "architecture")


@click.group()
def plugin():
    """Write moe-zoo plugins."""


@plugin.command("new")
@click.argument("name")
@click.option("--kind", required=True, metavar="|".join(KIND_NAMES),
              help="What the plugin provides: one component of this kind.")
@click.option("--dir", "parent", default=".", show_default=True, type=click.Path(file_okay=False),
              help="Folder to create moe-zoo-NAME/ in.")
def new(name, kind, parent):
    """Write an installable plugin package moe-zoo-NAME/: a working example component of KIND, its entry point,
    model-card template, demo Space, README and tests. NAME is lowercase words joined by dashes."""
    from zoo.components.scaffold import ScaffoldError, new_plugin

    try:
        target = new_plugin(name, kind, parent)
    except ScaffoldError as exc:
        raise click.UsageError(str(exc)) from None
    except OSError as exc:
        raise click.ClickException(f"could not write the plugin: {exc}") from None
    click.echo(f"wrote {target}\nnext:  cd {target} && moe-zoo install -e . && python -m pytest -q tests")


@click.command()
@click.argument("packages", nargs=-1)
@click.option("-e", "--editable", "editable", multiple=True, metavar="PATH",
              help="Install a local plugin folder in editable mode (repeatable).")
@click.option("-U", "--upgrade", is_flag=True, help="Upgrade the named packages (never the zoo's pinned libraries).")
@click.option("--no-deps", is_flag=True, help="Install the packages alone, without their dependencies.")
@click.option("--reinstall", is_flag=True,
              help="Reinstall the named packages even if they are up to date (not their dependencies: pip's "
                   "--force-reinstall would reinstall torch too).")
@click.option("--pre", is_flag=True, help="Include pre-release versions.")
@click.option("--no-index", is_flag=True, help="Do not use a package index (with --find-links, or local folders).")
@click.option("-f", "--find-links", multiple=True, metavar="URL|DIR", help="Also look for packages here (repeatable).")
@click.option("-i", "--index-url", metavar="URL", help="Base URL of the package index.")
@click.option("--extra-index-url", multiple=True, metavar="URL", help="Another package index (repeatable).")
@click.option("--no-build-isolation", is_flag=True,
              help="Build local folders with the build tools already installed (offline builds).")
@click.option("-q", "--quiet", is_flag=True, help="Less pip output.")
def install(packages, editable, upgrade, no_deps, reinstall, pre, no_index, find_links, index_url,
            extra_index_url, no_build_isolation, quiet):
    """Install plugin PACKAGES (pip requirement specifiers, wheels or folders) with pip, holding torch and the
    zoo's own libraries at their installed versions; then load every plugin in a fresh process and print one
    line per newly installed plugin: its components, or its error."""
    from zoo.components.install import InstallError, describe, load_check, new_plugins, run_pip, selected

    if not packages and not editable:
        raise click.UsageError("name at least one package to install (or -e PATH)")
    flags = [flag for flag, on in (("--upgrade", upgrade), ("--no-deps", no_deps or reinstall),
                                   ("--force-reinstall", reinstall), ("--pre", pre), ("--no-index", no_index),
                                   ("--no-build-isolation", no_build_isolation), ("--quiet", quiet)) if on]
    for url in find_links:
        flags += ["--find-links", url]
    flags += ["--index-url", index_url] if index_url else []
    for url in extra_index_url:
        flags += ["--extra-index-url", url]
    try:
        installed = run_pip(packages, editable, flags)
        rows, not_plugins = new_plugins(installed, load_check())
    except InstallError as exc:
        raise click.ClickException(str(exc)) from None
    for row in rows:
        note = "" if selected(row) else "  (not loaded here: MOE_ZOO_LOAD_PLUGINS does not name it)"
        click.echo(describe(row) + note)
    for dist in not_plugins:
        click.echo(f"{dist}: installed, but it has no moe_zoo entry point (not a moe-zoo plugin)")
    if not rows and not not_plugins:
        click.echo("no new plugin installed (what was asked for is installed already; --upgrade or --reinstall "
                   "to install it again)")
    broken = [row["name"] for row in rows if "error" in row]
    if broken:
        raise click.ClickException(f"installed, but {len(broken)} plugin(s) failed to load: {', '.join(broken)}")


def add_commands(cli) -> None:
    """Add ``plugin`` and ``install`` to the ``moe-zoo`` group."""
    cli.add_command(plugin)
    cli.add_command(install)
