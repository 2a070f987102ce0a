"""The ``moe-zoo`` command: its group and built-in commands (``main``), their shared helpers, and the commands of
generation, demos, plugins, training and the tour. ``zoo.cli.cli`` / ``zoo.cli.commands`` are the group and entry point."""
import importlib

from zoo import submodules

_module = submodules(__name__)


def __getattr__(name: str):
    if name == "cli":
        return importlib.import_module(f"{__name__}.commands").cli
    return _module(name)


def main(argv=None):
    """The ``moe-zoo`` entry point."""
    from zoo.cli.commands import main as run

    return run(argv)
