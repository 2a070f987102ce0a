"""moe-zoo: a plugin-based Mixture-of-Experts model zoo for the Hugging Face ecosystem.

The package is grouped in rooms that follow a model's path:

    moe/           the MoE core: SparseMoE, routers, expert kinds, kernels, layouts
    components/    what a component is and how it is found: bases, options, demo-control declarations, registry,
                   plugin manager, plugin install and scaffold
    architectures/ the model families, the zoo classes made from them, and what a saved folder needs to open
    io/            reading and writing checkpoints: lazy checkpoint, shards, atomic saves, finite checks, load,
                   convert, export (native, GGUF, compressed-tensors), adapter folders
    editing/       changing models: apply, the layer-at-a-time engine, streaming, calibration, statistics
    runtime/       running them: decode, its AOT step, expert offloading
    evaluation/    perplexity and usage, lm-evaluation-harness, the claims' verdicts
    training/      training the zoo's models and fine-tuning adapters
    publishing/    cards, the Hub, shipping the zoo's models
    cli/           the ``moe-zoo`` command
    demos/         what the Gradio Spaces build on
    data/, testing/  the corpus and tokenizer; checks for plugin authors

``import zoo`` is cheap: it imports neither torch nor transformers. The public names below resolve on first use
(PEP 562), and so does every room and module (``zoo.editing.calibration`` after a bare ``import zoo``). Module
paths from before the rooms (``zoo.loading``, ...) still import, with a warning (``zoo.moved``). The plugins load
at the registry's first lookup (``zoo.components.plugins``), and the ``zoo_<family>`` model types (plugin
architectures included) join transformers' Auto classes when transformers first looks up a ``zoo_`` model type,
e.g. in ``AutoModelForCausalLM.from_pretrained(saved_zoo_folder)``, whichever of zoo and transformers was imported
first.
"""
import importlib
import importlib.util
import sys
import types

from zoo.hookspecs import hookimpl

# public name -> the module that defines it (imported on first access)
_LAZY = {
    "Adapter": "zoo.components.bases", "Compressor": "zoo.components.bases",
    "Experts": "zoo.moe", "Router": "zoo.moe", "Routing": "zoo.moe", "RoutingContext": "zoo.moe",
    "load_plugins": "zoo.components.plugins",
    "convert": "zoo.io.convert", "export": "zoo.io.convert",
    "apply": "zoo.editing.apply", "list_components": "zoo.editing.apply",
    "list_models": "zoo.components.registry",
    "load": "zoo.io.load", "load_tokenizer": "zoo.io.loading",
    "card": "zoo.publishing.cards",
    "push_to_hub": "zoo.publishing.hub",
    "consolidate": "zoo.editing.consolidation",
    "offload": "zoo.runtime.offloading",
}
# modules that are public under a short name (``zoo.stream.plan``, ``zoo.claims.judge``)
_MODULES = {"stream": "zoo.editing.stream", "claims": "zoo.evaluation.claims"}
# old modules whose name is also a public function: ``import zoo.apply`` must not turn ``zoo.apply`` into the module
_SHADOWED = {"apply", "convert"}

__all__ = ["Adapter", "Compressor", "Experts", "Router", "Routing", "RoutingContext", "apply", "card", "consolidate",
           "convert", "export", "hookimpl", "list_components", "list_models", "load", "load_plugins", "load_tokenizer",
           "moe", "offload", "push_to_hub"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _MODULES:
        value = importlib.import_module(_MODULES[name])
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")  # a submodule: zoo.editing.calibration, zoo.moe, ...
        if name in _SHADOWED:
            value = getattr(value, name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    setattr(sys.modules[__name__], name, value)
    return value


def __dir__():
    return sorted({*globals(), *_LAZY, *_MODULES, *__all__})


def submodules(package: str):
    """A room's ``__getattr__``: its modules import on first use (``zoo.io.loading`` after ``import zoo``)."""
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{package}.{name}":
                raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    return __getattr__


class _Zoo(types.ModuleType):
    def __setattr__(self, name, value):
        if name in _SHADOWED and isinstance(value, types.ModuleType):
            value = getattr(value, name)  # the import system binds an (old) submodule on its parent: keep the function
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Zoo

from zoo import moved  # noqa: E402  (old module paths: a finder, imports nothing)
from zoo.components.plugins import auto_classes_at_first_need  # noqa: E402  (pluggy and the registry: cheap)

moved.install()
auto_classes_at_first_need()
