"""Experts: the compute half of an MoE block. Indices come from a Router; here they are only consumed."""
from __future__ import annotations

import functools

import torch
from torch import nn
import torch.nn.functional as F
from transformers import initialization as init
from transformers.activations import ACT2FN

from zoo.moe import kernels
from zoo.moe.cpu_precision import at_matmul_dtype
from zoo.moe.dispatch import gather_rows, run_sorted
from zoo.components.controls import DemoControls
from zoo.moe.routing import Routing
from zoo.components.options import check_options


def _accepts_native_call(forward):
    """``forward(hidden, routing)`` that also takes transformers' experts protocol ``(hidden_states,
    top_k_index, top_k_weights)``: the call its tensor/expert-parallel hooks make (``moe_tp_experts``,
    ``ep_dispatch_experts`` and the EP implementations behind it, with rank-local expert ids)."""

    @functools.wraps(forward)
    def wrapper(self, hidden, routing, top_k_weights=None, *args, **kwargs):
        if top_k_weights is not None:
            routing = Routing(top_k_weights, routing)
        return forward(self, hidden, routing, *args, **kwargs)

    wrapper._zoo_native_call = True
    return wrapper


class Experts(nn.Module, DemoControls):
    """Base class of expert kinds. ``forward(hidden [T, H], routing) -> [T, H]``.

    Every kind states its size honestly: ``num_parameters()`` counts stored elements, ``nbytes()`` counts
    stored bytes (packed integer weights and their scales included), ``active_parameters(k)`` what one
    token reads with k experts.
    """

    name: str = ""
    summary: str = ""
    paper: str = ""
    card: str = ""
    space: str = ""
    num_experts: int
    # A kind may define ``reference(self, hidden, routing) -> [T, H]``: a plain, obviously correct version of
    # ``forward`` (same signature, same result). ``zoo.testing.check_component`` compares the two, outputs and
    # gradients, on random inputs.
    reference = None
    # demo controls (zoo.components.controls): the options of __init__ but the layer's shape, which the layer fixes
    demo_skip = ("num_experts", "hidden_size", "intermediate_size")

    def __init_subclass__(cls, **kwargs):
        # Every kind, plugins' included, takes both calls: ``(hidden, routing)`` from the zoo block, and
        # ``(hidden, top_k_index, top_k_weights)`` from transformers' parallel hooks (see zoo.architectures.parallel).
        super().__init_subclass__(**kwargs)
        forward = cls.__dict__.get("forward")
        if forward is not None and not getattr(forward, "_zoo_native_call", False):
            cls.forward = _accepts_native_call(forward)

    def supports_tensor_parallel(self) -> bool:
        """Whether transformers' tensor-parallel experts plan (gate_up_proj split by output, down_proj by input,
        partial outputs summed across ranks) computes this module exactly. Kinds that store other tensors, or
        compute differently from a slice of the intermediate channels, stay whole on every rank."""
        return False

    def supports_expert_parallel(self) -> bool:
        """Whether splitting every tensor of this module along its first (expert) dimension gives each rank whole
        experts that compute as before with rank-local expert ids (transformers' ``grouped_gemm`` +
        ``ep_dispatch_experts``)."""
        return False

    def options(self) -> dict:
        """Constructor arguments that rebuild this module (stored in ``config.zoo_layout``)."""
        raise NotImplementedError

    def num_parameters(self) -> int:
        return sum(t.numel() for t in self.state_dict().values())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state_dict().values())

    def active_parameters(self, k: int) -> int:
        return self.num_parameters() * k // self.num_experts


def _silu_glu(gate, up, limit=None, alpha=None):
    return F.silu(gate) * up


def _glu_with(act):
    def glu(gate, up, limit=None, alpha=None):
        return act(gate) * up
    return glu


def _clamped_glu(gate, up, limit=7.0, alpha=1.702):
    # GPT-OSS: clamp, a sharper sigmoid gate, and a +1 on the linear half.
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _softcapped_swiglu(gate, up, gate_cap=4.0, up_cap=25.0):
    # Inkling2: the sigmoid sees the raw gate; soft-caps (cap * tanh(x / cap)) bound the linear gate factor and up.
    dtype, gate, up = gate.dtype, gate.float(), up.float()
    return (torch.tanh(gate / gate_cap) * gate_cap * torch.sigmoid(gate) * (torch.tanh(up / up_cap) * up_cap)).to(dtype)


def _clamped_silu(gate, up, limit=7.0, alpha=None):
    # DeepSeek-V4: SiLU gate clamped from above, linear half clamped both ways.
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def _post_clamped_silu(gate, up, limit=7.0, alpha=None):
    # Step 3.7: the clamp comes after the SiLU (caps silu(gate) at the limit, not silu of the capped gate).
    return F.silu(gate).clamp(max=limit) * up.clamp(min=-limit, max=limit)


# act(gate) * up for the activations transformers' MoE families use (``config.hidden_act`` names), plus GPT-OSS's
# Activations with parameters, and which of the two (swiglu_limit, swiglu_alpha) each reads: clamped-swiglu: clamp
# limit, sigmoid sharpness; clamped-silu and post-clamped-silu: clamp limit; softcapped-swiglu: the gate factor's
# soft-cap, up's soft-cap.
PARAMETERS = {"clamped-swiglu": ("swiglu_limit", "swiglu_alpha"), "clamped-silu": ("swiglu_limit",),
              "post-clamped-silu": ("swiglu_limit",),
              "softcapped-swiglu": ("swiglu_limit", "swiglu_alpha")}
ACTIVATIONS = {"silu": _silu_glu, "clamped-swiglu": _clamped_glu, "clamped-silu": _clamped_silu,
               "post-clamped-silu": _post_clamped_silu,
               "softcapped-swiglu": _softcapped_swiglu,
               **{name: _glu_with(ACT2FN[name]) for name in ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast",
                                                             "quick_gelu", "relu", "relu2", "swish", "tanh")}}
_TP_METHODS = ("forward", "expert", "glu", "_forward_sorted", "_forward_gather")


def use_kernel(hidden: torch.Tensor, routing, num_experts: int, *stored: torch.Tensor, packed: bool = False,
               any_count: bool = False, pairs: int | None = None) -> bool:
    """Whether an inference call on few tokens can run on ``zoo::moe_gemv`` (loaded by ``zoo.runtime.decode``'s
    compile config, or by the quantized experts' first call): no gradients, few tokens (a compiled step: at most
    ``kernels.MAX_TOKENS``; an eager call, a short prompt's prefill or an eager decode step: at most
    ``kernels.PAIRS_PER_EXPERT`` (token, slot) pairs per selected expert on average: fewer for ``packed`` weights
    (more on the avx2 set), more for bf16 and int8 ones on bf16 inputs where the processor has bf16 dot products),
    CPU tensors of float32/bfloat16 activations and contiguous stored weights. (Per selected expert, so that the
    same routing takes the same path whichever stack holds the experts: a consolidated model's pool, its own.)
    ``any_count``: whatever the number of tokens (stacks the other paths cannot read as they are); ``pairs``: an
    eager call's limit in place of ``PAIRS_PER_EXPERT``'s (2/3-bit codes read as stored: ``kernels.stored_pairs``)."""
    if not (kernels.ready() and not torch.is_grad_enabled() and hidden.device.type == "cpu"):
        return False
    if any_count:
        few = True
    elif torch.compiler.is_compiling():
        few = routing.indices.shape[0] <= kernels.MAX_TOKENS
    else:
        limit = pairs if pairs is not None else kernels.PAIRS_PER_EXPERT[kernels.eager_pairs_key(hidden, *stored,
                                                                                                  packed=packed)]
        chosen, selected = chosen_pairs(routing.indices, num_experts)
        few = chosen <= limit * max(1, selected)
    return few and hidden.dtype in (torch.float32, torch.bfloat16) and all(
        t.device.type == "cpu" and t.is_contiguous() for t in stored)


def chosen_pairs(indices: torch.Tensor, num_experts: int) -> tuple[int, int]:
    """How many (token, slot) pairs chose a real expert (empty slots: ``num_experts`` and up), and how many experts
    they chose. A decode step's or a short prompt's few indices are counted on the host (one small copy), where a
    mask, an index and ``unique`` took ~0.1 ms a call in a profile of the 304M model's 16-token prompt."""
    flat = indices.reshape(-1)
    if flat.numel() <= 1024:
        chosen = [e for e in flat.tolist() if 0 <= e < num_experts]
        return len(chosen), len(set(chosen))
    counts = torch.bincount(flat.clamp(0, num_experts), minlength=num_experts + 1)[:num_experts]
    return int(counts.sum()), int(counts.count_nonzero())


def naive_experts(module, hidden: torch.Tensor, routing) -> torch.Tensor:
    """Every (token, slot) pair through ``module.expert`` alone, weighted and summed: the reference of the sorted
    and gathered dispatch (kinds that define ``expert(e, x)`` inherit it)."""
    rows = []
    for t in range(hidden.shape[0]):
        row = hidden.new_zeros(hidden.shape[-1])
        for slot, e in enumerate(routing.indices[t].tolist()):
            if e < module.num_experts:  # index E: an empty slot
                row = row + routing.weights[t, slot].to(hidden.dtype) * module.expert(e, hidden[t:t + 1])[0]
        rows.append(row)
    return torch.stack(rows)


class SwiGLUExperts(Experts):
    """Dense fused SwiGLU experts in the transformers v5 layout: ``gate_up_proj [E, 2I, H]`` (gate rows
    first, then up rows) and ``down_proj [E, H, I]``; optional biases ``[E, 2I]`` and ``[E, H]``."""

    name = "swiglu"
    summary = "Dense fused SwiGLU experts (transformers v5 layout), sort-based dispatch, gather path for decode."
    card = "cards/swiglu.md"
    space = "model-zoo"

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str = "silu",
                 bias: bool = False, swiglu_limit: float = 7.0, swiglu_alpha: float = 1.702):
        super().__init__()
        check_options(type(self), {"activation": activation, "bias": bias, "swiglu_limit": swiglu_limit,
                                   "swiglu_alpha": swiglu_alpha})
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose from {sorted(ACTIVATIONS)}")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.activation, self.swiglu_limit, self.swiglu_alpha = activation, swiglu_limit, swiglu_alpha
        self._act = ACTIVATIONS[activation]
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden_size)) if bias else None
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def init_weights(self, std: float) -> None:
        """Initialise what a load left missing, as transformers initialises native fused experts."""
        init.normal_(self.gate_up_proj, mean=0.0, std=std)
        init.normal_(self.down_proj, mean=0.0, std=std)
        for bias in (self.gate_up_proj_bias, self.down_proj_bias):
            if bias is not None:
                init.zeros_(bias)

    def options(self) -> dict:
        opts = {"num_experts": self.num_experts, "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size, "activation": self.activation,
                "bias": self.gate_up_proj_bias is not None}
        opts.update({name: getattr(self, name) for name in PARAMETERS.get(self.activation, ())})
        return opts

    def _stored(self) -> set[str]:
        return {n for n, _ in self.named_parameters(recurse=False)} | {n for n, _ in self.named_buffers(recurse=False)}

    def supports_tensor_parallel(self) -> bool:
        # Exact when each rank's slice of the intermediate channels is independent: SwiGLU's own compute on its
        # own two weights, no biases (a down-projection bias would be added once per rank). Subclasses that
        # change the compute (e.g. a per-token channel selection) or what is stored get False.
        cls = type(self)
        own = all(getattr(cls, m) is getattr(SwiGLUExperts, m) for m in _TP_METHODS)
        return own and self._stored() == {"gate_up_proj", "down_proj"}

    def supports_expert_parallel(self) -> bool:
        # Whole experts per rank: any per-expert compute fits, as long as all that is stored is per expert.
        return self._stored() <= {"gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"}

    reference = naive_experts

    def glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self._act(gate, up, self.swiglu_limit, self.swiglu_alpha)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """One expert on its own slice of tokens, ``x [n, H] -> [n, H]``; bf16 widened to fp32 on a CPU without
        native bf16 products (``zoo.moe.cpu_precision``), the output rounded back."""
        b1 = None if self.gate_up_proj_bias is None else self.gate_up_proj_bias[e]
        b2 = None if self.down_proj_bias is None else self.down_proj_bias[e]
        xm, w1, w2, b1, b2 = at_matmul_dtype(x, self.gate_up_proj[e], self.down_proj[e], b1, b2)
        return F.linear(self.glu(F.linear(xm, w1, b1)), w2, b2).to(x.dtype)

    def forward(self, hidden: torch.Tensor, routing) -> torch.Tensor:
        tokens, k = routing.indices.shape
        # Inference on few tokens (a compiled decode step, a short prompt, an eager step): the zoo's kernel reads
        # the selected experts in place, where it is loaded. Otherwise compiled code gathers the selected experts'
        # weights (static shapes, no host sync) and eager code sorts the pairs by expert: slicing experts by Python
        # index reads weights in place, where the gather would copy whole expert matrices.
        if not torch.compiler.is_compiling() and not torch.is_grad_enabled() and hidden.device.type == "cpu":
            # eager inference too: without the kernel a CPU without native bf16 products widened each selected
            # expert to fp32 per call (304M model, bf16, eager decode 24 tok/s against transformers' eager 44)
            kernels.load()
        if use_kernel(hidden, routing, self.num_experts, self.gate_up_proj, self.down_proj):
            return self._forward_kernel(hidden, routing)
        if torch.compiler.is_compiling() and tokens * k <= self.num_experts:
            return self._forward_gather(hidden, routing)
        return self._forward_sorted(hidden, routing)

    # transformers' experts functions (``experts_implementation``) that compute these experts: they read the fused
    # layout this kind stores, and call its gate function for the activation
    TRANSFORMERS_IMPLEMENTATIONS = ("grouped_mm", "batched_mm")

    def transformers_forward(self, implementation: str, hidden: torch.Tensor, routing) -> torch.Tensor:
        """These experts run by transformers' own ``implementation`` (``grouped_mm``: one grouped GEMM per
        projection; ``batched_mm``: a batched matmul over each pair's gathered expert). Empty slots become expert 0
        with weight 0."""
        from types import SimpleNamespace

        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        empty = routing.indices >= self.num_experts
        view = SimpleNamespace(  # the attributes transformers' functions read off a native experts module
            num_experts=self.num_experts, gate_up_proj=self.gate_up_proj, down_proj=self.down_proj,
            gate_up_proj_bias=self.gate_up_proj_bias, down_proj_bias=self.down_proj_bias,
            has_bias=self.gate_up_proj_bias is not None, has_gate=True, is_transposed=False, is_concatenated=True,
            has_post_expert_norm=False, _is_expert_parallel=False, _apply_gate=self.glu)
        return ALL_EXPERTS_FUNCTIONS[implementation](view, hidden, routing.indices.masked_fill(empty, 0),
                                                     routing.weights.masked_fill(empty, 0))

    def _forward_sorted(self, hidden, routing):
        """Prefill: sort (token, slot) pairs by expert, run each expert on its contiguous slice."""
        return run_sorted(hidden, routing.indices, routing.weights, self.num_experts, self.expert)

    def _forward_kernel(self, hidden, routing):
        """Compiled inference on few tokens: the selected experts read in place by the zoo's kernel
        (``zoo::moe_gemv``, opaque to the compiler), each selected weight row once."""
        stack = (self.gate_up_proj, None, self.down_proj, None, 16, 64, None)
        return kernels.expert_block(hidden, routing.indices, routing.weights, [stack], self.num_experts, self.glu,
                                    self.gate_up_proj_bias, self.down_proj_bias)

    def _forward_gather(self, hidden, routing):
        """Decode: few tokens meet few experts, so gather the selected experts' weights (no host sync)."""
        idx, valid = gather_rows(routing.indices, self.num_experts)
        k = routing.indices.shape[1]
        x = hidden.repeat_interleave(k, dim=0).unsqueeze(-1)  # [T*k, H, 1]
        h = torch.bmm(self.gate_up_proj[idx], x).squeeze(-1)
        if self.gate_up_proj_bias is not None:
            h = h + self.gate_up_proj_bias[idx]
        y = torch.bmm(self.down_proj[idx], self.glu(h).unsqueeze(-1)).squeeze(-1)
        if self.down_proj_bias is not None:
            y = y + self.down_proj_bias[idx]
        w = torch.where(valid, routing.weights.reshape(-1), 0).to(y.dtype)  # empty slots: ignored, even if NaN
        return (y * w[:, None]).view(hidden.shape[0], k, y.shape[-1]).sum(1).to(hidden.dtype)


class MLPExperts(Experts):
    """Dense fused experts without a gate (Nemotron-H): ``up_proj [E, I, H]``, ``down_proj [E, H, I]``, each expert
    ``down(act(up x))`` with a transformers activation (``relu2`` for Nemotron-H); optional biases ``up_proj_bias
    [E, I]`` and ``down_proj_bias [E, H]`` (``bias=True``)."""

    name = "mlp"
    summary = "Dense fused ungated MLP experts (up, activation, down), sort-based dispatch, gather path for decode."
    card = "cards/mlp.md"
    space = "model-zoo"

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str = "relu2",
                 bias: bool = False):
        super().__init__()
        check_options(type(self), {"activation": activation, "bias": bias})
        if activation not in ACT2FN:
            raise ValueError(f"unknown activation {activation!r}")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.activation, self._act = activation, ACT2FN[activation]
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.up_proj_bias = nn.Parameter(torch.zeros(num_experts, intermediate_size)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden_size)) if bias else None
        nn.init.normal_(self.up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def init_weights(self, std: float) -> None:
        init.normal_(self.up_proj, mean=0.0, std=std)
        init.normal_(self.down_proj, mean=0.0, std=std)
        for bias in (self.up_proj_bias, self.down_proj_bias):
            if bias is not None:
                init.zeros_(bias)

    def options(self) -> dict:
        opts = {"num_experts": self.num_experts, "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size, "activation": self.activation}
        # recorded only when set: layouts saved before the option still match (kinds built on this one may store
        # no biases at all)
        if getattr(self, "up_proj_bias", None) is not None:
            opts["bias"] = True
        return opts

    reference = naive_experts

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        b1 = None if self.up_proj_bias is None else self.up_proj_bias[e]
        b2 = None if self.down_proj_bias is None else self.down_proj_bias[e]
        xm, w1, w2, b1, b2 = at_matmul_dtype(x, self.up_proj[e], self.down_proj[e], b1, b2)  # (SwiGLUExperts.expert)
        return F.linear(self._act(F.linear(xm, w1, b1)), w2, b2).to(x.dtype)

    def forward(self, hidden: torch.Tensor, routing) -> torch.Tensor:
        tokens, k = routing.indices.shape
        # experts one neuron wide (product-key memories: Doge, PEER): gathering each pair's two rows reads no more
        # than the pairs need, where the sorted path would loop over thousands of experts
        if (torch.compiler.is_compiling() and tokens * k <= self.num_experts) or self.intermediate_size == 1:
            idx, valid = gather_rows(routing.indices, self.num_experts)
            x = hidden.repeat_interleave(k, dim=0).unsqueeze(-1)  # [T*k, H, 1]
            h = torch.bmm(self.up_proj[idx], x).squeeze(-1)
            if self.up_proj_bias is not None:
                h = h + self.up_proj_bias[idx]
            y = torch.bmm(self.down_proj[idx], self._act(h).unsqueeze(-1)).squeeze(-1)
            if self.down_proj_bias is not None:
                y = y + self.down_proj_bias[idx]
            w = torch.where(valid, routing.weights.reshape(-1), 0).to(y.dtype)
            return (y * w[:, None]).view(tokens, k, -1).sum(1).to(hidden.dtype)
        return run_sorted(hidden, routing.indices, routing.weights, self.num_experts, self.expert)
