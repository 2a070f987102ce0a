"""The MoE core: the canonical block (routing apart from experts, experts apart from dispatch), the expert kinds,
their CPU kernels (``kernels/``) and layouts. Imports only itself and the component declarations (controls,
options, the registry): nothing of io, editing, the demos or the command line."""
from zoo.moe.block import SharedMLP, SparseMoE
from zoo.moe.context import RoutingContext, routing_context
from zoo.moe.experts import Experts, SwiGLUExperts
from zoo.moe.losses import load_balancing_loss, model_load_balancing_loss, z_loss
from zoo.moe.routing import Router, Routing

__all__ = ["Experts", "Router", "Routing", "RoutingContext", "SharedMLP", "SparseMoE", "SwiGLUExperts",
           "load_balancing_loss", "model_load_balancing_loss", "routing_context", "z_loss"]
