"""moe-zoo: a plugin-based Mixture-of-Experts model zoo for the Hugging Face ecosystem.

``import zoo`` loads the plugins and registers every ``zoo_<family>`` model type with the Auto classes.
"""
from zoo.hookspecs import hookimpl
from zoo.components import Adapter, Compressor
from zoo.moe import Experts, Router, Routing
from zoo import moe
from zoo.plugins import load_plugins
from zoo.convert import convert, export
from zoo.apply import apply, list_components
from zoo.registry import list_models, load, load_tokenizer
from zoo.cards import card
from zoo.hub import push_to_hub

__all__ = ["Adapter", "Compressor", "Experts", "Router", "Routing", "apply", "card", "convert", "export", "hookimpl",
           "list_components", "list_models", "load", "load_tokenizer", "moe", "push_to_hub"]

load_plugins()
