"""SparseMoE: the one module type every plugin works on."""
from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from zoo.moe import context
from zoo.moe.block_parts import PARTS, PartsMismatch, part_problems
from zoo.moe.experts import ACTIVATIONS, PARAMETERS, Experts, SwiGLUExperts
from zoo.moe.routing import Router, Routing


class SharedMLP(nn.Module):
    """Always-on shared expert(s): a gated MLP (SiLU by default; ``glu=False``: ungated), optionally scaled by a
    sigmoid gate (Qwen2-MoE).

    ``num_experts`` S: the intermediate width holds S experts side by side (S equal slices), which a router may weigh
    per token (``Routing.shared_weights`` [T, S], passed as ``weights``: each slice's activations times its weight,
    as Inkling weighs its shared experts). Without weights they add up as one MLP of the whole width."""

    def __init__(self, hidden_size: int, intermediate_size: int, gated: bool = False, activation: str = "silu",
                 scale: float = 1.0, glu: bool = True, swiglu_limit: float = 7.0, swiglu_alpha: float = 1.702,
                 num_experts: int = 1):
        super().__init__()
        if activation not in (ACTIVATIONS if glu else ACT2FN):
            raise ValueError(f"unknown activation {activation!r} for the shared experts")
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1 \
                or intermediate_size % num_experts:
            raise ValueError(f"num_experts must be a positive integer dividing intermediate_size "
                             f"({intermediate_size}), got {num_experts!r}")
        self.num_experts = num_experts
        self.hidden_size, self.intermediate_size, self.activation = hidden_size, intermediate_size, activation
        self.scale = float(scale)  # Cohere2-MoE's "average" combination halves the shared and the routed outputs
        self.swiglu_limit, self.swiglu_alpha = float(swiglu_limit), float(swiglu_alpha)  # clamped activations
        self.act_fn = ACTIVATIONS[activation] if glu else ACT2FN[activation]
        # glu=False: an ungated MLP, down(act(up x)) (Nemotron-H's shared expert)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False) if glu else None
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate = nn.Linear(hidden_size, 1, bias=False) if gated else None

    def options(self) -> dict:
        opts = {"hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "gated": self.gate is not None}
        if self.activation != "silu":
            opts["activation"] = self.activation
        if self.gate_proj is None:
            opts["glu"] = False
        opts.update({name: getattr(self, name) for name in PARAMETERS.get(self.activation, ())})
        if self.num_experts != 1:
            opts["num_experts"] = self.num_experts
        return opts if self.scale == 1.0 else {**opts, "scale": self.scale}

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """``x [T, H]``; ``weights [T, S]``: each shared expert's weight per token (None: 1 each)."""
        up = self.up_proj(x)
        if self.gate_proj is None:
            hidden = self.act_fn(up)
        else:
            hidden = self.act_fn(self.gate_proj(x), up, self.swiglu_limit, self.swiglu_alpha)
        if weights is not None:  # expert s's slice of the activations times its weight (down_proj is linear)
            hidden = (hidden.unflatten(-1, (self.num_experts, -1)) * weights.to(hidden.dtype)[..., None]).flatten(-2)
        out = self.down_proj(hidden)
        out = out if self.gate is None else torch.sigmoid(self.gate(x)) * out
        return out if self.scale == 1.0 else out * self.scale


class SparseMoE(nn.Module):
    """``SparseMoE(router, experts, shared_experts=None)``: [B, S, H] -> [B, S, H].

    ``returns_router_scores`` makes it return ``(out, weights)`` for families whose decoder layer
    unpacks a tuple (GPT-OSS). Router logits reach ``output_router_logits`` through a recorder on
    ``Router`` outputs (see ``zoo.architectures.factory``).

    Parts around the experts (``zoo.moe.block_parts``, each optional): ``input_proj`` and ``input_norm`` make what
    the routed experts read (the router and the shared experts read the block's input itself), ``expert_output_norm``
    norms each expert's output before its weight scales it, ``output_proj`` maps the weighted sum back to the
    model's width, ``output_bias`` is added to it, ``output_norm`` norms the block's output (routed plus shared).
    Every compressor and export carries them: they are part of the block.

    ``expert_map`` (HC-SMoE's merged experts behind an unchanged router): the router keeps its E rows and picks
    among the original experts; original expert e is served by merged expert ``expert_map[e]`` (the router's
    output is mapped, see ``zoo.moe.routing.map_routing``). ``num_experts`` is then the merged count.

    ``identity_experts`` Z (LongCat-Flash's zero-computation experts): the router has E + Z rows; a token routed to
    row E + j (j < Z) gets ``weight * x`` added, ``x`` being the block's input (before ``input_norm``), and costs
    no compute. ``num_experts`` stays E, the experts that compute; indices from E + Z up are empty slots, as ever.

    A router that weighs the shared experts per token (``Router.shared_rows`` S > 0, Inkling's ``inkling-topk``)
    needs S shared experts beside it (``SharedMLP(num_experts=S)``); its ``Routing.shared_weights`` go to them.

    ``carries_router_state`` (Zaya, whose decoder layers hand a router state from one MoE block to the next): the block
    is called ``block(hidden, router_state)`` and returns ``(out, state)``; a router that carries state
    (``Router.carries_state``) reads the one handed in and gives the next ([B, S, R]); any other router hands on None.
    """

    zoo_moe_block = True  # how code that must not import the MoE core finds the blocks (demo-control declarations)

    def __init__(self, router: Router, experts: Experts, shared_experts: nn.Module | None = None,
                 returns_router_scores: bool = False, weights_scale_input: bool = False, expert_map=None,
                 input_norm: nn.Module | None = None, output_norm: nn.Module | None = None,
                 identity_experts: int = 0, input_proj: nn.Module | None = None,
                 expert_output_norm: nn.Module | None = None, output_proj: nn.Module | None = None,
                 output_bias: nn.Module | None = None, carries_router_state: bool = False):
        super().__init__()
        if carries_router_state and returns_router_scores:
            raise ValueError("a block returns either its router scores or its router state beside its output, not both")
        parts = {"input_proj": input_proj, "input_norm": input_norm, "expert_output_norm": expert_output_norm,
                 "output_proj": output_proj, "output_bias": output_bias, "output_norm": output_norm}
        width, expert_width = getattr(unwrapped(router), "hidden_size", None), getattr(experts, "hidden_size", None)
        problems = part_problems(parts, width, expert_width) if width and expert_width else []
        if problems:
            raise PartsMismatch(problems)
        self.identity_experts = check_identity_experts(identity_experts, expert_map)
        self._expert_map = None if expert_map is None else check_expert_map(expert_map, router.num_experts,
                                                                            experts.num_experts)
        if self._expert_map is None and router.num_experts != experts.num_experts + self.identity_experts:
            raise ValueError(f"router has {router.num_experts} experts but experts has {experts.num_experts}"
                             + (f" and {self.identity_experts} identity experts (needs "
                                f"{experts.num_experts + self.identity_experts} router rows)"
                                if self.identity_experts else ""))
        check_shared_rows(router, shared_experts)
        self.router, self.experts, self.shared_experts = router, experts, shared_experts
        for name, part in parts.items():
            setattr(self, name, part)
        self.returns_router_scores = returns_router_scores
        self.carries_router_state = bool(carries_router_state)
        # transformers' experts function the model's ``experts_implementation`` names, run where the experts are plain
        # fused SwiGLU experts (``SwiGLUExperts.transformers_forward``); "eager": the zoo's own dispatch
        self.experts_implementation = "eager"
        # Llama 4: the routing weight scales each expert's input, not its output (not the same through SwiGLU)
        self.weights_scale_input = weights_scale_input

    def __setattr__(self, name, value):
        if name == "router" and isinstance(value, Router):  # a swapped-in router keeps the block's map
            value.serving_map = self.__dict__.get("_expert_map")
        super().__setattr__(name, value)

    def with_parts(self, router: Router | None = None, experts: Experts | None = None,
                   expert_map=...) -> SparseMoE:
        """A block like this one (shared experts, flags, expert map unless ``expert_map`` is given: None drops
        it) with a new router and/or new experts."""
        block = SparseMoE(self.router if router is None else router, self.experts if experts is None else experts,
                          self.shared_experts, self.returns_router_scores, self.weights_scale_input,
                          self._expert_map if expert_map is ... else expert_map,
                          identity_experts=self.identity_experts, carries_router_state=self.carries_router_state,
                          **self.parts())
        block.experts_implementation = self.experts_implementation
        return block

    def parts(self) -> dict:
        """The block's parts around its experts (``zoo.moe.block_parts.PARTS``), by name; None where absent."""
        return {name: getattr(self, name) for name in PARTS}

    @property
    def expert_map(self) -> tuple[int, ...] | None:
        """Original expert -> merged expert that serves it (None: every router row has its own expert)."""
        return self._expert_map

    @property
    def num_experts(self) -> int:
        # the router's count: expert parallelism leaves ``experts.num_experts`` at the experts this rank holds;
        # behind an expert map, the merged experts the router's rows are served by
        if self._expert_map is not None:
            return max(self._expert_map) + 1
        return unwrapped(self.router).num_experts - self.identity_experts

    def unmapped(self) -> SparseMoE:
        """The same function without the map: each of the router's E experts gets its own copy of the merged
        expert that serves it (what a native checkpoint can hold; as large as before merging)."""
        if self._expert_map is None:
            return self
        import copy

        index = torch.tensor(self._expert_map, dtype=torch.long)
        opts = {**self.experts.options(), "num_experts": len(index)}
        with torch.device("meta"):
            experts = type(self.experts)(**opts)
        experts.load_state_dict({k: v.index_select(0, index.to(v.device))
                                 for k, v in self.experts.state_dict().items()}, assign=True)
        router = copy.deepcopy(self.router)
        return self.with_parts(router, experts, expert_map=None)

    @property
    def top_k(self) -> int:
        return unwrapped(self.router).top_k

    def forward(self, hidden: torch.Tensor, router_state: torch.Tensor | None = None, **family_inputs):
        """``router_state``: the previous MoE block's router state (``carries_router_state``). ``family_inputs``: what a
        family's decoder layer hands its block besides the hidden states (DeepSeek-V4 passes ``input_ids``); routers
        read such facts from the routing context instead, so they are ignored."""
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        if not x.shape[0] and not (self.carries_router_state or self.returns_router_scores):
            return torch.zeros_like(hidden)  # no tokens (a modality part, zoo.moe.modality): nothing to route
        routing = self.route(x, router_state if self.carries_router_state else None)
        xe = self.expert_inputs(x)
        computing = self.computing_routing(routing)
        if self.expert_output_norm is not None:
            out = self._normed_experts(xe, computing)
        elif self.weights_scale_input:
            out = self._input_scaled_experts(xe, computing)
        elif getattr(self.experts, "_is_hooked", False):
            out = self._parallel_experts(xe, computing)
        elif self.experts_implementation != "eager" and type(self.experts) is SwiGLUExperts:
            out = self.experts.transformers_forward(self.experts_implementation, xe, computing)
        else:
            out = self.experts(xe, computing)
        if self.output_proj is not None:
            out = self.output_proj(out)
        if self.identity_experts:
            out = out + self.identity_output(x, routing)
        if self.output_bias is not None:
            out = self.output_bias(out)
        if self.shared_experts is not None:
            shared = routing.shared_weights
            out = out + (self.shared_experts(x) if shared is None else self.shared_experts(x, shared))
        if self.output_norm is not None:
            out = self.output_norm(out)
        out = out.view(shape)
        if self.carries_router_state:
            return out, None if routing.state is None else routing.state.view(*shape[:-1], -1)
        return (out, routing.weights) if self.returns_router_scores else out

    def computing_routing(self, routing: Routing) -> Routing:
        """The routing the experts see: slots of identity experts become empty slots (index E), so every experts
        kind skips them as it skips any empty slot."""
        if not self.identity_experts:
            return routing
        return routing._replace(indices=routing.indices.clamp(max=self.num_experts))

    def identity_output(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """``[T, H]``: each token's input times the summed weight of the identity experts it was routed to."""
        E = self.num_experts
        chosen = (routing.indices >= E) & (routing.indices < E + self.identity_experts)
        weight = torch.where(chosen, routing.weights, 0).sum(-1, keepdim=True)  # other slots' weights: ignored
        return x * weight.to(x.dtype)

    def expert_inputs(self, x: torch.Tensor) -> torch.Tensor:
        """What the routed experts read of the block's input ``x [T, H]`` (code that runs experts on calibration
        tokens calls this: the block's input is what the router reads)."""
        x = x if self.input_proj is None else self.input_proj(x)
        return x if self.input_norm is None else self.input_norm(x)

    def route(self, x: torch.Tensor, state: torch.Tensor | None = None) -> Routing:
        """The router's choice for tokens ``x [T, H]``, with the routing context when the router reads it, and the
        previous MoE layer's router state ``state`` when it carries one."""
        # called through a PEFT wrapper where there is one (LoRA on ``router.weight``), its facts read off the router
        router = unwrapped(self.router)
        args = (x, context.current()) if router.uses_context else (x,)
        return self.router(*args, state=state) if router.carries_state else self.router(*args)

    def _input_scaled_experts(self, x: torch.Tensor, routing) -> torch.Tensor:
        """Each (token, slot) pair as its own row, scaled by its weight, sent to its expert with weight 1."""
        tokens, k = routing.indices.shape
        empty = routing.indices >= self.num_experts  # their weight is ignored, even if NaN
        w = routing.weights.masked_fill(empty, 0).to(x.dtype)
        rows = (x[:, None, :] * w[..., None]).reshape(tokens * k, -1)
        flat = routing.indices.reshape(tokens * k, 1)
        out = self.experts(rows, Routing(torch.ones_like(flat, dtype=x.dtype), flat))
        return out.view(tokens, k, -1).sum(1)

    def _normed_experts(self, x: torch.Tensor, routing) -> torch.Tensor:
        """Each (token, slot) pair as its own row sent to its expert with weight 1, the expert's output normed, then
        scaled by the slot's weight and summed per token (a norm between expert and weight is not linear)."""
        tokens, k = routing.indices.shape
        empty = routing.indices >= self.num_experts  # their weight is ignored, even if NaN
        flat = routing.indices.reshape(tokens * k, 1)
        rows = x[:, None, :].expand(tokens, k, x.shape[-1]).reshape(tokens * k, -1)
        out = self.expert_output_norm(self.experts(rows, Routing(torch.ones_like(flat, dtype=x.dtype), flat)))
        w = routing.weights.masked_fill(empty, 0)
        return (out.view(tokens, k, -1) * w[..., None]).to(x.dtype).sum(1)

    def _parallel_experts(self, x: torch.Tensor, routing) -> torch.Tensor:
        """The experts under transformers' tensor/expert-parallel hooks (``zoo.architectures.parallel``): called
        with its experts protocol ``(hidden_states, top_k_index, top_k_weights)``, which the hooks transform
        (all-reduce-backward of the weights, token dispatch to the ranks holding the experts). Its EP dispatch
        indexes by expert id, so empty slots (id E) become expert 0 with weight 0 here."""
        empty = routing.indices >= self.num_experts
        indices = routing.indices.masked_fill(empty, 0)
        weights = routing.weights.masked_fill(empty, 0)
        return self.experts(x, indices, weights)

    def layout(self) -> dict:
        """A JSON-able description that ``zoo.moe.layout.build_block`` turns back into an empty block."""
        experts_options = self.experts.options()
        if "num_experts" in experts_options:  # the global count, also where expert parallelism narrowed the module's
            experts_options["num_experts"] = self.num_experts
        return {
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.top_k,
            "router": self.router.name,
            "router_options": dict(self.router.options),
            "experts": self.experts.name,
            "experts_options": experts_options,
            "shared_experts": None if self.shared_experts is None else self.shared_experts.options(),
            "returns_router_scores": self.returns_router_scores,
            **({"weights_scale_input": True} if self.weights_scale_input else {}),
            **({"expert_map": list(self._expert_map)} if self._expert_map is not None else {}),
            **({"identity_experts": self.identity_experts} if self.identity_experts else {}),
            **({"carries_router_state": True} if self.carries_router_state else {}),
            **{name: part.options() for name, part in self.parts().items() if part is not None},
        }


def unwrapped(module: nn.Module) -> nn.Module:
    """The module a PEFT layer wraps (LoRA on one of its parameters, e.g. ``target_parameters=["router.weight"]``
    or the router's own name in ``target_modules``), else the module itself."""
    return module.get_base_layer() if hasattr(module, "get_base_layer") else module


def check_shared_rows(router: nn.Module, shared_experts: nn.Module | None) -> None:
    """ValueError unless a router that weighs S shared experts per token (``Router.shared_rows``) sits beside S."""
    rows = getattr(unwrapped(router), "shared_rows", 0)
    held = 0 if shared_experts is None else getattr(shared_experts, "num_experts", 1)
    if rows and rows != held:
        raise ValueError(f"router {unwrapped(router).name!r} weighs {rows} shared experts per token but the block "
                         f"holds {held} (shared_experts.num_experts must be {rows})")


def check_identity_experts(identity_experts, expert_map=None) -> int:
    """The number of identity experts as an int, or ValueError: a non-negative integer, none behind an expert map
    (a map names one merged expert per router row; identity rows have no expert to merge)."""
    if isinstance(identity_experts, bool) or not isinstance(identity_experts, int) or identity_experts < 0:
        raise ValueError(f"identity_experts must be a non-negative integer, got {identity_experts!r}")
    if identity_experts and expert_map is not None:
        raise ValueError("identity experts cannot sit behind an expert map (merged experts serve router rows one "
                         "for one; an identity row has no expert to merge)")
    return identity_experts


def check_expert_map(expert_map, router_experts: int, num_merged: int) -> tuple[int, ...]:
    """An expert map as a tuple, or ValueError: one entry per router row, each naming a merged expert, every
    merged expert named at least once."""
    values = list(expert_map) if isinstance(expert_map, (list, tuple)) else None
    if values is None or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"expert_map must be a list of integers, got {expert_map!r}")
    if len(values) != router_experts:
        raise ValueError(f"expert_map has {len(values)} entries but the router has {router_experts} experts")
    if sorted(set(values)) != list(range(num_merged)):
        raise ValueError(f"expert_map must name each of the {num_merged} experts (0..{num_merged - 1}) at least "
                         f"once, got {values}")
    return tuple(values)
