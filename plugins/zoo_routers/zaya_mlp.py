"""zaya-mlp: Zaya's router, a small MLP over a narrow copy of the block input that also carries a state from one MoE
layer to the next.

Each token's block input is projected down to ``router_hidden_size`` R (``down_proj``, with a bias); a router that
``reads_state`` adds the state the previous MoE layer's router handed on, scaled per channel
(``router_states_scale``). The sum is this router's state, handed on to the next layer's router (``Routing.state``):
each layer routes on a sum over depth of the down-projected inputs, earlier layers' decayed by the scales (Zyphra's
exponential depth averaging). The state goes
through an RMS norm, two GELU layers (``fc1``, ``fc2``, R -> R) and an output layer with one row per expert
(``weight [E, R]``) plus one for skipping the experts (``skip_weight [1, R]``). A softmax over those E + 1 classes
gives the probabilities; the k classes with the highest probability plus a selection-only bias (``balancing_bias``,
``skip_bias``; Zaya starts the skip class at -1) are picked, each weighted by its probability (no renormalisation). A
pick of the skip class computes nothing: it is an empty slot (index E, weight 0). The logits are the E + 1 classes'
(``bias=True``, which Zaya does not use, adds a bias to the experts' logits).

Without a state (the first MoE layer, or a block called on its own) nothing is added, as in Zaya. Outside a model's
forward (a compressor routing a layer's calibration tokens), the state comes from the routing context, where the
layer-at-a-time engine puts the state each token's block was handed. The skip class is no expert: pruning and
merging keep its row (the expert rows are those with E of them, so R must differ from E).

Zaya's own rule, as transformers 5.24 runs it (``ZayaRouter``); the family's report: Zyphra, ZAYA1-8B Technical
Report, 2026, arXiv:2605.05365 (``zoo.architectures.zaya``)."""
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from zoo.moe import Router, Routing
from zoo.moe import context as routing_context
from zoo.moe.norms import BlockRMSNorm


class ZayaMLP(Router):
    name = "zaya-mlp"
    summary = ("Zaya routing: an MLP over a down-projected block input plus the previous MoE layer's router state, "
               "softmax over the experts and a skip class, top-k by probability plus a selection bias.")
    card = "cards/zaya-mlp.md"
    space = "router-explorer"
    carries_state = True

    def __init__(self, hidden_size, num_experts, top_k, router_hidden_size: int = 256, reads_state: bool = True,
                 eps: float = 1e-5, **options):
        R = router_hidden_size
        if isinstance(R, bool) or not isinstance(R, int) or R < 1:
            raise ValueError(f"router_hidden_size must be a positive integer, got {R!r}")
        if R == num_experts:  # surgery tells a router's per-expert tensors by their first dimension
            raise ValueError(f"router_hidden_size ({R}) must differ from the number of experts: pruning and merging "
                             "tell the router's expert rows by their count")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
            raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
        super().__init__(hidden_size, num_experts, top_k, router_hidden_size=R, reads_state=bool(reads_state),
                         eps=float(eps), **options)
        self.router_hidden_size, self.reads_state = R, bool(reads_state)
        self.down_proj = nn.Linear(hidden_size, R)
        self.router_states_scale = nn.Parameter(torch.ones(R)) if reads_state else None
        self.norm = BlockRMSNorm(R, float(eps))
        self.fc1, self.fc2 = nn.Linear(R, R), nn.Linear(R, R)
        self.weight = nn.Parameter(torch.empty(num_experts, R))  # the output layer's expert rows
        self.skip_weight = nn.Parameter(torch.empty(1, R))  # and its skip class's
        for w in (self.weight, self.skip_weight):
            nn.init.normal_(w, std=0.02)
        # selection-only biases, updated outside backprop by Zaya's balancing: fp32 buffers
        self.balancing_bias = nn.Buffer(torch.zeros(num_experts, dtype=torch.float32))
        self.skip_bias = nn.Buffer(torch.full((1,), -1.0, dtype=torch.float32))

    def init_weights(self, std: float) -> None:
        """As Zaya initialises its router: linears normal (biases zero), scale and norm ones, the skip class's
        selection bias -1."""
        for w in (self.down_proj.weight, self.fc1.weight, self.fc2.weight, self.weight, self.skip_weight):
            init.normal_(w, mean=0.0, std=std)
        for b in (self.down_proj.bias, self.fc1.bias, self.fc2.bias, self.balancing_bias, self.bias):
            if b is not None:
                init.zeros_(b)
        init.ones_(self.norm.weight)
        if self.router_states_scale is not None:
            init.ones_(self.router_states_scale)
        init.constant_(self.skip_bias, -1.0)

    def carried(self, hidden: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor | None:
        """The previous layer's state ``[T, R]`` for these rows: the one handed in, else the routing context's."""
        if state is None:
            ctx = routing_context.current()
            state = None if ctx is None else ctx.router_state
            if state is not None and state.shape[0] != hidden.shape[0]:
                raise ValueError(f"the routing context's router state has {state.shape[0]} rows for "
                                 f"{hidden.shape[0]} hidden rows: this block does not run on the engine's tokens")
        return None if state is None else state.reshape(hidden.shape[0], -1).to(hidden.dtype)

    def forward(self, hidden: torch.Tensor, state: torch.Tensor | None = None) -> Routing:
        h = self.down_proj(hidden)
        previous = self.carried(hidden, state) if self.reads_state else None
        if previous is not None:
            h = h + previous * self.router_states_scale
        features = F.gelu(self.fc2(F.gelu(self.fc1(self.norm(h)))))
        bias = None if self.bias is None else torch.cat([self.bias, self.bias.new_zeros(1)])
        logits = F.linear(features, torch.cat([self.weight, self.skip_weight]), bias)
        probs = logits.softmax(-1)
        choice = probs.detach().float() + torch.cat([self.balancing_bias, self.skip_bias])
        indices = choice.topk(self.top_k, dim=-1).indices  # index E: the skip class, an empty slot
        weights = probs.gather(1, indices).masked_fill(indices == self.num_experts, 0)
        return Routing(weights=weights.to(hidden.dtype), indices=indices, logits=logits, state=h)

    def reference(self, hidden: torch.Tensor, context=None, state: torch.Tensor | None = None) -> Routing:
        """Token by token, written out."""
        E, rows = self.num_experts, []
        for t, x in enumerate(hidden):
            h = self.down_proj.weight @ x + self.down_proj.bias
            if self.reads_state and state is not None:
                h = h + state[t] * self.router_states_scale
            n = h / torch.sqrt(h.pow(2).mean() + self.norm.eps) * self.norm.weight
            a = F.gelu(self.fc1.weight @ n + self.fc1.bias)
            a = F.gelu(self.fc2.weight @ a + self.fc2.bias)
            logits = torch.stack([self.weight[e] @ a + (0 if self.bias is None else self.bias[e]) for e in range(E)]
                                 + [self.skip_weight[0] @ a])
            p = torch.exp(logits - logits.max())
            p = p / p.sum()
            bias = [self.balancing_bias[e] for e in range(E)] + [self.skip_bias[0]]
            order = sorted(range(E + 1), key=lambda e: -(p[e].item() + bias[e].item()))[:self.top_k]
            w = torch.stack([p[e] if e < E else p[e] * 0 for e in order])
            rows.append((w, torch.tensor(order), logits, h))
        w, i, lg, h = (torch.stack(c) for c in zip(*rows))
        return Routing(weights=w.to(hidden.dtype), indices=i, logits=lg, state=h)
