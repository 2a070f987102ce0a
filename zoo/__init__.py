"""moe-zoo: a plugin-based Mixture-of-Experts model zoo for the Hugging Face ecosystem.

``import zoo`` is cheap: it imports neither torch nor transformers. The public names below resolve on first use
(PEP 562), and so does every submodule (``zoo.calibration`` after a bare ``import zoo``). The plugins load at the
registry's first lookup (``zoo.plugins``), and the ``zoo_<family>`` model types (plugin architectures included)
join transformers' Auto classes when transformers first looks up a ``zoo_`` model type, e.g. in
``AutoModelForCausalLM.from_pretrained(saved_zoo_folder)``, whichever of zoo and transformers was imported first.
"""
import importlib
import importlib.util
import sys
import types

from zoo.hookspecs import hookimpl

# public name -> the module that defines it (imported on first access)
_LAZY = {
    "Adapter": "zoo.components", "Compressor": "zoo.components",
    "Experts": "zoo.moe", "Router": "zoo.moe", "Routing": "zoo.moe", "RoutingContext": "zoo.moe",
    "load_plugins": "zoo.plugins",
    "convert": "zoo.convert", "export": "zoo.convert",
    "apply": "zoo.apply", "list_components": "zoo.apply",
    "list_models": "zoo.registry",
    "load": "zoo.loading", "load_tokenizer": "zoo.loading",
    "card": "zoo.cards",
    "push_to_hub": "zoo.hub",
    "consolidate": "zoo.consolidation",
    "offload": "zoo.offloading",
}
# submodules whose name is also a public function: ``import zoo.apply`` must not turn ``zoo.apply`` into the module
_SHADOWED = {"apply", "convert"}

__all__ = ["Adapter", "Compressor", "Experts", "Router", "Routing", "RoutingContext", "apply", "card", "consolidate",
           "convert", "export", "hookimpl", "list_components", "list_models", "load", "load_plugins", "load_tokenizer",
           "moe", "offload", "push_to_hub"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")  # a submodule: zoo.calibration, zoo.moe, ...
        if name in _SHADOWED:
            value = getattr(value, name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    setattr(sys.modules[__name__], name, value)
    return value


def __dir__():
    return sorted({*globals(), *_LAZY, *__all__})


class _Zoo(types.ModuleType):
    def __setattr__(self, name, value):
        if name in _SHADOWED and isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.{name}":
            value = getattr(value, name)  # the import system binds a submodule on its parent: keep the function
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Zoo

from zoo.plugins import auto_classes_at_first_need  # noqa: E402  (pluggy and the registry: cheap)

auto_classes_at_first_need()
