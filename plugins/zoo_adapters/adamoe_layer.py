"""AdaMoE's upcycled layer (Shen et al., 2025, arXiv:2510.14300), what ``upcycle`` builds with ``router="adamoe"``:
the dense FFN stays as an always-on shared expert (it inherits the pretrained weights unchanged), the upcycled
copies become routed experts behind an AdaMoE router (``zoo_routers.adamoe``), and the layer returns the average
of the two paths, ``0.5 * shared(x) + 0.5 * sum_e w_e expert_e(x)`` (the shared MLP at scale 0.5, the router's
``routed_scale`` 0.5)."""
from __future__ import annotations

import torch

MIX = 0.5  # the paper's equal mix of the shared (dense) path and the routed path


@torch.no_grad()
def to_adamoe(model, mlps, gate_rows, top_k: int, std: float, generator: torch.Generator):
    """Turn ``model`` (just upcycled from the dense ``mlps``, its routers holding ``gate_rows``) into AdaMoE's
    layers: per layer a shared expert copied from the dense FFN and an AdaMoE router whose gate is the given
    rows and whose scale adapter is drawn from N(0, std^2), independently of the gate. Returns the model."""
    from zoo.io.convert import hook_new_routers
    from zoo.moe.layout import moe_layers
    from zoo.moe.block import SharedMLP
    from zoo.moe.surgery import place_like
    from zoo_routers.adamoe import AdaMoE

    routers = []
    for (_, moe), mlp, rows in zip(moe_layers(model), mlps, gate_rows):
        E, H = rows.shape
        router = AdaMoE(H, E, top_k, routed_scale=MIX)
        router.weight.copy_(rows)
        router.scale_adapter.copy_(torch.randn(E, H, generator=generator) * std)
        moe.router = place_like(router, moe.router)
        routers.append(moe.router)
        w = mlp.gate_proj.weight
        with torch.device("meta"):
            shared = SharedMLP(H, w.shape[0], scale=MIX)
        shared.load_state_dict({f"{name}.weight": getattr(mlp, name).weight.detach().clone()
                                for name in ("gate_proj", "up_proj", "down_proj")}, assign=True)
        moe.shared_experts = shared
    hook_new_routers(model, routers)
    return model
