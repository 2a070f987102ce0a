"""An example third-party plugin: needs nothing but ``zoo.hookimpl`` and ``zoo.Router``."""
import torch

import zoo


class SwitchTop1(zoo.Router):
    """Switch Transformers routing: each token goes to its single most probable expert, weighted by
    that probability (not renormalised, so the gate keeps a gradient)."""

    name = "example-switch-top1"
    summary = "Switch-style top-1 routing weighted by the unnormalised router probability."
    paper = "Fedus et al., Switch Transformers, 2021. arXiv:2101.03961"
    card = "cards/example-switch-top1.md"
    space = "router-explorer"

    def __init__(self, hidden_size, num_experts, top_k=1, **options):
        if top_k != 1:
            raise ValueError(f"{self.name} routes each token to exactly one expert; got top_k={top_k}")
        super().__init__(hidden_size, num_experts, 1, **options)

    def forward(self, hidden):
        logits = self.gate_logits(hidden)
        probs = torch.softmax(logits.float(), dim=-1)
        weight, index = probs.max(dim=-1, keepdim=True)
        return zoo.Routing(weights=weight.to(hidden.dtype), indices=index, logits=logits)


@zoo.hookimpl
def register_routers(register):
    register(SwitchTop1)
