"""Hook specifications of the ``moe_zoo`` pluggy project. Each hook receives a ``register`` callback.

Names are first come, first served, the zoo's own plugins first: a component, model or command whose name is
taken is refused (a component or model clash refuses all of that plugin's components) and reported by
``moe-zoo plugins``.
"""
import pluggy

hookspec = pluggy.HookspecMarker("moe_zoo")
hookimpl = pluggy.HookimplMarker("moe_zoo")


@hookspec
def register_architectures(register):
    """Register model family specs (``zoo.architectures.Family`` instances) for convert/export/load."""


@hookspec
def register_routers(register):
    """Register ``zoo.Router`` subclasses."""


@hookspec
def register_experts(register):
    """Register ``zoo.Experts`` subclasses (expert kinds, multimodal groups included)."""


@hookspec
def register_adapters(register):
    """Register ``zoo.Adapter`` subclasses."""


@hookspec
def register_compressors(register):
    """Register ``zoo.Compressor`` subclasses."""


@hookspec
def register_models(register):
    """Register ``zoo.registry.ModelEntry`` records for ``zoo.list_models``."""


@hookspec
def register_commands(cli):
    """Add click commands to ``cli`` (a click group); they join ``moe-zoo`` unless the name is taken by a
    built-in command or an earlier plugin's (such a command is refused and reported as this plugin's error)."""
