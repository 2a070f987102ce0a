"""What a component is and how it is found: the Adapter/Compressor bases, options, the demo-control declarations,
the registry, the plugin manager, plugin install and scaffold. ``zoo.components.Adapter`` is the base in ``bases``."""
import importlib

from zoo import submodules

_module = submodules(__name__)


def __getattr__(name: str):
    if name in ("Adapter", "Compressor"):
        return getattr(importlib.import_module(f"{__name__}.bases"), name)
    return _module(name)
