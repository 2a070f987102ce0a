"""Routing: which experts each token goes to, and with what weight. No compute happens here."""
from __future__ import annotations

import functools
import inspect
from typing import NamedTuple

import torch
from torch import nn
from transformers import initialization as init

from zoo.components.controls import (Control, DemoControls, controls_from_signature, defaults_of, layer_experts,
                                layer_top_k)
from zoo.components.options import check_options
from zoo.moe.cpu_precision import linear


class _RoutingFields(NamedTuple):
    weights: torch.Tensor  # [T, k]
    indices: torch.Tensor  # [T, k] long
    logits: torch.Tensor | None = None  # [T, E]


class Routing(_RoutingFields):
    """The result of a router for T tokens: ``Routing(weights [T, k], indices [T, k], logits [T, E] | None)``.

    ``indices`` equal to the number of experts mark an empty slot (a token routed to fewer than k experts,
    as with expert-choice); their weight is ignored. A NamedTuple of those three, so transformers' output recorders
    can pick ``logits`` by position and code that unpacks or iterates a routing sees the three it always saw.
    Two keyword-only extras ride beside them as attributes (None unless a router gives them):
    ``shared_weights`` [T, S]: a router that weighs the block's S shared experts per token (Inkling's,
    ``inkling-topk``) gives each token's weight of each; None: the shared experts' own weight.
    ``state`` [T, R]: what a router that carries state (``Router.carries_state``) hands the next MoE layer's router.
    """

    shared_weights: torch.Tensor | None = None
    state: torch.Tensor | None = None

    def __new__(cls, weights, indices, logits=None, *, shared_weights=None, state=None):
        routing = super().__new__(cls, weights, indices, logits)
        if shared_weights is not None:
            routing.shared_weights = shared_weights
        if state is not None:
            routing.state = state
        return routing

    def _replace(self, **changes) -> Routing:
        """A copy with ``changes`` (fields or extras), the extras kept."""
        return Routing(**{"weights": self.weights, "indices": self.indices, "logits": self.logits,
                          "shared_weights": self.shared_weights, "state": self.state, **changes})


def map_routing(routing: Routing, expert_map, num_merged: int) -> Routing:
    """A choice among the router's E experts, served by merged experts: ``expert_map [E]`` (a sequence or a long
    tensor) sends original expert e to merged expert ``expert_map[e]`` in ``[0, num_merged)``. Two slots of a token
    that land on the same merged expert become one slot with their weights summed (the other slot is left empty,
    index ``num_merged``, weight 0): the same output as running that expert once per slot. Empty input slots
    (index E) stay empty. The logits (and shared weights) stay the router's."""
    idx, w = routing.indices, routing.weights
    table = torch.as_tensor(list(expert_map) + [num_merged], dtype=torch.long, device=idx.device)
    empty = idx >= len(table) - 1
    w = w.masked_fill(empty, 0)
    mapped = table[idx.clamp(max=len(table) - 1)]
    same = mapped[:, :, None] == mapped[:, None, :]  # [T, k, k]
    k = idx.shape[-1]
    earlier = torch.ones(k, k, dtype=torch.bool, device=idx.device).tril(-1)  # slot j < slot i
    repeat = (same & earlier).any(-1)  # a slot whose merged expert an earlier slot already has
    summed = (same.to(w.dtype) * w[:, None, :]).sum(-1)
    return routing._replace(weights=summed.masked_fill(repeat, 0), indices=mapped.masked_fill(repeat, num_merged))


def _mapped_forward(forward):
    """``forward`` followed by the block's expert map, when one is set (``Router.serving_map``)."""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        routing = forward(self, *args, **kwargs)
        # mapped once, by the class's own forward (not by a parent's forward it calls through super())
        if self.serving_map is None or type(self).forward is not wrapper or not isinstance(routing, Routing):
            return routing
        return map_routing(routing, self.serving_map, max(self.serving_map) + 1)

    wrapper._zoo_mapped = True
    return wrapper


class Router(nn.Module, DemoControls):
    """Base class of routers: a linear gate ``weight [E, H]`` (optionally with ``bias [E]``) plus a
    selection rule implemented by ``forward``. Subclasses pass all their options up so the layout can
    record and rebuild them.

    Declared capabilities (class attributes a subclass overrides):
    ``uses_context``: ``forward(hidden, context)`` receives the call's ``zoo.moe.RoutingContext`` (token ids,
    positions, attention mask, modality tags; see ``zoo.moe.context``), or None outside a model call.
    ``target``: "experts" (the MoE block's router) or "attention" (the router wraps self-attention heads and
    is put in place by a classmethod ``attach(model, layers=None, **options)``).
    Demo controls (``zoo.components.controls``): ``demo_controls(model)`` defaults to a top-k slider plus the options
    of ``__init__``; ``demo_presets(model)`` and ``demo_unfit(model)`` as for every component.
    """

    name: str = ""
    summary: str = ""
    paper: str = ""
    card: str = ""
    space: str = ""
    uses_context: bool = False
    target: str = "experts"
    # A router may define ``reference(self, hidden, context=None) -> Routing``: a plain, obviously correct version
    # of ``forward``; ``zoo.testing.check_component`` compares the two, outputs and gradients.
    reference = None
    # Set by ``SparseMoE`` when merged experts serve the router's E experts (HC-SMoE's expert map): ``forward``'s
    # choice among the E experts is then mapped to the merged ones (``map_routing``), so every reader of the
    # router's output (the block, statistics, usage hooks) sees the experts that run. None: no map.
    serving_map: tuple[int, ...] | None = None
    # Rows of ``weight`` (and ``bias``) after the E experts' that score the block's shared experts (``inkling-topk``:
    # S, and its output's ``shared_weights``); the block checks them against its shared experts, and pruning and
    # merging keep them after the kept experts' rows (``zoo.moe.surgery``).
    shared_rows: int = 0
    # ``carries_state``: ``forward(hidden, state=None)`` also reads the router state the previous MoE layer's router
    # handed on ([T, R] or None) and gives its own as ``Routing.state`` (Zaya's ``zaya-mlp``); the block passes it
    # from layer to layer where the family's decoder layers do (``SparseMoE(carries_router_state=True)``).
    carries_state: bool = False
    # ``keep_rows(rows) -> Router``, for a router whose gate has no row per expert (``product-key``: each sub-key
    # serves many experts): this router for only its experts ``rows``, which pruning and expert-map merging call
    # (``zoo.moe.surgery``); such a router cannot be cut to one row per group. None: the gate's rows are the experts'.
    keep_rows = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        forward = cls.__dict__.get("forward")
        if forward is not None and not getattr(forward, "_zoo_mapped", False):
            cls.forward = _mapped_forward(forward)

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, bias: bool = False, **options):
        super().__init__()
        check_options(type(self), {"bias": bias, **options}, skip=("hidden_size", "num_experts", "top_k"))
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= int(num_experts):
            raise ValueError(f"top_k must be an integer in [1, {num_experts}], got {top_k!r}")
        self.hidden_size, self.num_experts, self.top_k = int(hidden_size), int(num_experts), int(top_k)
        self.options = {"bias": bool(bias), **options}
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_experts)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

    demo_skip = ("hidden_size", "num_experts", "top_k", "bias", "layer", "base")  # the last two: zoo.apply's


    @classmethod
    def demo_controls(cls, model=None) -> list[Control]:
        """A top-k slider (the class's own default k, else the model's; up to its expert count), then the
        ``__init__`` options."""
        own = inspect.signature(cls.__init__).parameters.get("top_k")
        k = own.default if own is not None and isinstance(own.default, int) else layer_top_k(model) or 2
        top_k = Control("top_k", "int", k, low=1, high=layer_experts(model) or 8, step=1, help="experts per token")
        return [top_k] + controls_from_signature(cls, cls.demo_skip, model)

    @classmethod
    def demo_presets(cls, model=None) -> dict[str, dict]:
        """mild: the controls' defaults (the model's k); strong: the same with one expert per token."""
        mild = defaults_of(cls.demo_controls(model))
        return {"mild": mild, "strong": {**mild, "top_k": 1} if "top_k" in mild else mild}

    @classmethod
    def check_layers(cls, layers: list[int], options: dict) -> None:
        """Raise (before any router is built) if ``options`` name layers other than the MoE ``layers``."""

    def init_weights(self, std: float) -> None:
        """Initialise what a load left missing (as transformers initialises a native router's gate)."""
        init.normal_(self.weight, mean=0.0, std=std)
        if self.bias is not None:
            init.zeros_(self.bias)

    def gate_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, E] raw router logits (bf16 multiplied in fp32 where torch's bf16 products are not native)."""
        return linear(hidden, self.weight, self.bias)

    def forward(self, hidden: torch.Tensor, context=None) -> Routing:  # pragma: no cover - abstract
        """``hidden [T, H]`` -> ``Routing``; ``context`` only when the class sets ``uses_context``."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"hidden={self.hidden_size}, experts={self.num_experts}, k={self.top_k}, options={self.options}"
