"""moe-zoo: a plugin-based Mixture-of-Experts model zoo for the Hugging Face ecosystem.

``import zoo`` registers every ``zoo_<family>`` model type with transformers' Auto classes and loads the plugins
(see ``zoo.plugins``: when a plugin module is what imported zoo, they load at the registry's first lookup).
"""
from zoo.hookspecs import hookimpl
from zoo.components import Adapter, Compressor
from zoo.moe import Experts, Router, Routing, RoutingContext
from zoo import moe
from zoo.plugins import load_plugins, load_unless_a_plugin_is_importing
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
load_unless_a_plugin_is_importing()
