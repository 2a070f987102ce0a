"""Toy routers for tests/test_check_component.py: one correct, and one for each classic reload bug that
``zoo.testing.check_component`` must catch. A plugin module that is not installed: the checker registers it (here
and in its fresh process) through ``plugins=["checker_toys"]``."""
import torch
import torch.nn.functional as F

import zoo
from zoo.moe import Router, Routing


class ScaledRouter(Router):
    """Softmax top-k over ``scale * logits``: correct. ``scale`` is a non-persistent buffer, rebuilt on load by
    ``init_weights``; ``reference`` is a slow per-token version of ``forward``."""

    name = "toy-scaled"
    summary = "Softmax top-k over scaled logits (correct)."

    def __init__(self, hidden_size, num_experts, top_k, scale: float = 3.0, **options):
        super().__init__(hidden_size, num_experts, top_k, scale=scale, **options)
        self.register_buffer("scale", torch.full((num_experts,), float(scale)), persistent=False)

    def init_weights(self, std):
        super().init_weights(std)
        self.scale.fill_(self.options["scale"])

    def forward(self, hidden):
        logits = self.gate_logits(hidden) * self.scale
        weights, indices = F.softmax(logits, dim=-1, dtype=torch.float32).topk(self.top_k, dim=-1)
        return Routing(weights=(weights / weights.sum(-1, keepdim=True)).to(hidden.dtype), indices=indices,
                       logits=logits)

    def reference(self, hidden):
        rows = [self.forward(hidden[t:t + 1]) for t in range(hidden.shape[0])]
        return Routing(*(torch.cat(parts) for parts in zip(*rows)))


class UninitialisedRouter(ScaledRouter):
    """Bug: nothing rebuilds the non-persistent ``scale`` on load, so it is uninitialised memory there."""

    name = "toy-uninitialised"

    def init_weights(self, std):
        Router.init_weights(self, std)


class CastOnReloadRouter(ScaledRouter):
    """Bug: a persistent fp32 ``offset`` that ``init_weights`` (run on load only) casts to bfloat16."""

    name = "toy-cast-on-reload"

    def __init__(self, hidden_size, num_experts, top_k, **options):
        super().__init__(hidden_size, num_experts, top_k, **options)
        self.offset = torch.nn.Buffer(torch.randn(num_experts) * 3)

    def init_weights(self, std):
        super().init_weights(std)
        self.offset.data = self.offset.data.to(torch.bfloat16)  # "to save memory": a load runs this, apply not

    def gate_logits(self, hidden):
        return super().gate_logits(hidden) + self.offset


class UnsavedOptionRouter(ScaledRouter):
    """Bug: ``sharp`` is not passed up to ``Router.__init__``, so it is not saved and a load uses its default."""

    name = "toy-unsaved-option"

    def __init__(self, hidden_size, num_experts, top_k, sharp: bool = False, **options):
        super().__init__(hidden_size, num_experts, top_k, **options)
        self.sharp = sharp

    def gate_logits(self, hidden):
        return super().gate_logits(hidden) * (4.0 if self.sharp else 1.0)


class WrongReferenceRouter(ScaledRouter):
    """Bug: ``forward`` applies the scale twice; its ``reference`` once."""

    name = "toy-wrong-reference"

    def forward(self, hidden):
        return ScaledRouter.forward(self, hidden * self.scale[0])

    def reference(self, hidden):
        return ScaledRouter.forward(self, hidden)


@zoo.hookimpl
def register_routers(register):
    for cls in (ScaledRouter, UninitialisedRouter, CastOnReloadRouter, UnsavedOptionRouter, WrongReferenceRouter):
        register(cls)
