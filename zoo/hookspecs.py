"""Hook specifications of the ``moe_zoo`` pluggy project. Each hook receives a ``register`` callback (or, for
commands, the click group); docs/plugins/ documents every hook with an example the test suite runs.

Names are first come, first served, the zoo's own plugins first: a component, model or command whose name is
taken is refused (a component or model clash refuses all of that plugin's components) and reported by
``moe-zoo plugins``. A hook implementation whose name is no hook below is reported too.
"""
import pluggy

hookspec = pluggy.HookspecMarker("moe_zoo")
hookimpl = pluggy.HookimplMarker("moe_zoo")


@hookspec
def register_architectures(register):
    """Register model family specs (``zoo.architectures.Family`` instances) for convert, export and load; their
    ``zoo_<name>`` model types join transformers' Auto classes when the plugins load."""


@hookspec
def register_routers(register):
    """Register ``zoo.Router`` subclasses (``zoo.apply(model, name, **options)`` swaps every MoE layer's router)."""


@hookspec
def register_experts(register):
    """Register ``zoo.Experts`` subclasses (expert kinds, multimodal groups included): a saved layout names
    them, and loading rebuilds them from their ``options()``."""


@hookspec
def register_adapters(register):
    """Register ``zoo.Adapter`` subclasses (``attach(model) -> model``; optional train_step, loss, merge)."""


@hookspec
def register_compressors(register):
    """Register ``zoo.Compressor`` subclasses (per-layer ``compress_layer``, or a whole-model ``compress``)."""


@hookspec
def register_models(register):
    """Register ``zoo.components.registry.ModelEntry`` records for ``zoo.list_models`` and ``zoo.load(name)``."""


@hookspec
def register_commands(cli):
    """Add click commands to ``cli`` (a click group); they join ``moe-zoo`` unless the name is taken by a
    built-in command or an earlier plugin's (such a command is refused and reported as this plugin's error).
    ``moe-zoo`` calls it before any other hook, to list the commands: import heavy libraries inside the commands."""
