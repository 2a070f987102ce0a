"""moe-zoo: a plugin-based Mixture-of-Experts model zoo for the Hugging Face ecosystem.

``import zoo`` registers the zoo's ``zoo_<family>`` model types with transformers' Auto classes. Plugins load on
first use (the first registry lookup, e.g. ``zoo.apply`` or ``zoo.list_components``), or with
``zoo.load_plugins()``; a plugin's own architectures (``zoo_mm``) join the Auto classes then.
"""
from zoo.hookspecs import hookimpl
from zoo.components import Adapter, Compressor
from zoo.moe import Experts, Router, Routing, RoutingContext
from zoo import moe
from zoo.plugins import load_plugins
from zoo.convert import convert, export
from zoo.apply import apply, list_components
from zoo.registry import list_models
from zoo.loading import load, load_tokenizer
from zoo.cards import card
from zoo.hub import push_to_hub
from zoo.architectures import register_auto_classes

__all__ = ["Adapter", "Compressor", "Experts", "Router", "Routing", "RoutingContext", "apply", "card", "convert",
           "export", "hookimpl", "list_components", "list_models", "load", "load_plugins", "load_tokenizer", "moe",
           "push_to_hub"]

register_auto_classes()
