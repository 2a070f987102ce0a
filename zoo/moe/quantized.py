"""Quantized experts: real packed low-bit weights and torch's own CPU low-bit matmul kernels.

Per expert and projection, a weight ``W [N, K]`` is stored as
  * 8 bits: ``int8 [N, K]`` with one scale per output channel (torch's int8 kernel is per-channel);
  * 4 bits: torch's CPU int4 pack (``uint8 [N, K/2]``) with a bf16 scale and zero per ``group_size`` inputs;
  * 2 or 3 bits: the codes densely packed (``uint8 [N, K*bits/8]``, see ``zoo.moe.packing``) with the same
    per-group scale and zero. torch has no 2/3-bit CPU kernel, so on first use each such weight is
    expanded into the int4 pack (its codes fit in 0..15) and runs on the int4 kernels: 2/3 bits on disk
    and in the saved model, 4 bits in the kernels' working copy (the zoo's kernel reads the stored codes
    instead where ``kernels.STORED_CODES`` measured that faster: no copy then).
Experts in one layer may use different bit widths (mixed-precision allocation), and the two projection stacks
different group sizes (``group_sizes``, FineQuant's adaptive choice; every width of a projection shares it). Inputs
get gradients (through the dequantized weight); the packed weights are frozen. Gated experts are
``QuantizedExperts`` (``quantized``), ungated ones ``QuantizedMLPExperts`` (``quantized-mlp``): the same stacks
(``PackedStacks``) under their projections' names.
"""
from __future__ import annotations

import torch
from transformers import initialization as init
from transformers.activations import ACT2FN

from zoo.moe import kernels
from zoo.moe.dispatch import gather_rows, run_sorted
from zoo.moe.experts import MLPExperts, SwiGLUExperts, chosen_pairs, use_kernel
from zoo.moe.init import refuse_missing
from zoo.moe.in_place import PREFILL_ROWS, TILE_ROWS, kernel_linear, lowbit_experts
from zoo.moe.packing import dequantize, int4pack, pack, unpack  # dequantize: the reference, named here too

BITS = (2, 3, 4, 8)


def quantize_int8(w: torch.Tensor):
    scale = (w.abs().amax(1).float() / 127).clamp(min=1e-12)
    q = w.to(torch.float32, copy=True).div_(scale[:, None]).round_().clamp_(-128, 127).to(torch.int8)
    return q, scale


def quantize_grouped(w: torch.Tensor, group_size: int, bits: int = 4, symmetric: bool = False):
    """Asymmetric per-group codes in [0, 2**bits); returns the stored weight (torch's int4 pack for 4 bits,
    dense 2/3-bit packing otherwise), the [K/g, N, 2] bf16 scale/zero and the codes.
    ``symmetric``: ``w = q s`` instead (``quantize_symmetric``), in the same layout."""
    if symmetric:
        return quantize_symmetric(w, group_size, bits)
    n, k = w.shape
    g = w.to(torch.float32, copy=True).view(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    top = 2 ** bits - 1
    scale = ((hi - lo) / top).clamp(min=1e-12)
    # in place on the fp32 copy: one temporary the size of W instead of four (the same arithmetic, in order)
    q = g.sub_(lo[..., None]).div_(scale[..., None]).round_().clamp_(0, top).to(torch.int32).view(n, k)
    del g
    stored = int4pack(q) if bits == 4 else pack(q, bits)
    # the int4 kernel computes (q - 8) * scale + zero, so zero = lo + 8 * scale (for every width)
    scale_zero = torch.stack([scale.t(), (lo + 8 * scale).t()], -1).to(torch.bfloat16).contiguous()
    return stored, scale_zero, q


def quantize_symmetric(w: torch.Tensor, group_size: int, bits: int = 4):
    """Symmetric per-group codes: ``w = q s`` with ``q`` in the signed range ``-2**(bits-1) .. 2**(bits-1) - 1``
    (-8..7 at 4 bits, compressed-tensors' symmetric int4) and one scale per group, no zero. The scale is the
    smallest that puts every weight of the group in that range before rounding, ``max(-min / 2**(bits-1),
    max / (2**(bits-1) - 1))`` (``max|w| / 8`` when the largest magnitude is negative, ``max|w| / 7`` when positive
    at 4 bits), so no code is clipped. Stored as ``quantize_grouped`` stores its codes, so the same kernels compute
    it: codes ``u = q + 2**(bits-1)`` in [0, 2**bits) and the int4 kernel's ``(u - 8) s + z`` with
    ``z = (8 - 2**(bits-1)) s``: 0 at 4 bits, 4 s at 3 and 6 s at 2, each exact in bf16 (a 2-bit scale is rounded
    up to 6 significant bits for it), so the stored weight is exactly ``q s``."""
    n, k = w.shape
    half = 2 ** (bits - 1)
    g = w.to(torch.float32, copy=True).view(n, k // group_size, group_size)
    scale = torch.maximum(-g.amin(-1) / half, g.amax(-1) / (half - 1)).clamp_(min=1e-12)
    if bits == 2:  # 6 s is exact in bf16 for a scale of at most 6 significant bits; rounded up, nothing clips
        mantissa, exponent = torch.frexp(scale)
        scale = torch.ldexp(torch.ceil(mantissa * 64) / 64, exponent)
    scale = scale.to(torch.bfloat16).float()  # the codes are those of the scale as stored
    q = g.div_(scale[..., None]).round_().clamp_(-half, half - 1).add_(half).to(torch.int32).view(n, k)
    del g
    stored = int4pack(q) if bits == 4 else pack(q, bits)
    scale_zero = torch.stack([scale.t(), ((8 - half) * scale).t()], -1).to(torch.bfloat16).contiguous()
    return stored, scale_zero, q


def int4_pack(bits: int, q: torch.Tensor, k: int) -> torch.Tensor:
    """The int4-kernel form of a stored 2/3/4-bit weight."""
    return q if bits == 4 else int4pack(unpack(q, bits, k))


@torch.library.custom_op("zoo::int8_weight_mm", mutates_args=())
def int8_weight_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """torch's int8 weight-pack matmul as an opaque op: inductor's own lowering of it fails on a gathered
    (unrealised) scale inside the compiled decode step, so the compiler just calls the kernel."""
    return torch.ops.aten._weight_int8pack_mm(x, q, scale.to(x.dtype))


@int8_weight_mm.register_fake
def _(x, q, scale):
    return x.new_empty(x.shape[0], q.shape[0])


class _LowBitLinear(torch.autograd.Function):
    """y = x @ W.T with a packed W; backward gives x its gradient through the dequantized weight."""

    @staticmethod
    def forward(ctx, x, q, scale, bits, group_size, shape):
        ctx.save_for_backward(q, scale)
        ctx.meta = (bits, group_size, shape)
        rows = x.shape[0]
        # int8 on few rows: the opaque op, which inductor calls as it is, unless the tiles serve (never when compiling)
        if bits == 8 and rows < PREFILL_ROWS and not (rows >= TILE_ROWS[8]
                                                      and kernels.lowbit_gemm_fits(x, q, bits, group_size)):
            return int8_weight_mm(x, q, scale)
        return kernel_linear(x, q, scale, bits, group_size)

    @staticmethod
    def backward(ctx, grad):
        q, scale = ctx.saved_tensors
        bits, group_size, shape = ctx.meta
        w = dequantize(bits, q, scale, shape, group_size).to(grad.dtype)
        return grad @ w, None, None, None, None, None


def lowbit_linear(x, q, scale, bits, group_size, shape):
    lead = x.shape[:-1]
    y = _LowBitLinear.apply(x.reshape(-1, x.shape[-1]).contiguous(), q, scale, bits, group_size, tuple(shape))
    return y.view(*lead, shape[0])


def pick(stack: torch.Tensor, i) -> torch.Tensor:
    """stack[i] for a Python int (a view) or a 0-d index tensor (a gather with a static shape: indexing by
    a tensor scalar would make the compiler read its value on the host)."""
    return stack[i] if isinstance(i, int) else stack.index_select(0, i.reshape(1))[0]


class PackedStacks:
    """What packed experts share, gated or not: per projection (``self.shapes``, name -> weight shape ``(N, K)``,
    in the order the experts apply them) and per width, one stack of packed weights and their scales; index tables
    that find an expert's width and slot without a host sync; the 2/3-bit working copies for the int4 kernels (torch's,
    and the zoo's where ``kernels.reads_stored_codes`` is false)."""

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on tokens ``x`` (its own width and slot; ``_expert_at`` is the kind's formula)."""
        return self._expert_at(self.bits[e], self.slot[e], x, e)

    def _build_stacks(self, bits, group_size: int, group_sizes: dict | None, shapes: dict, inputs: dict) -> None:
        """Check the options and register the (empty) stacks. ``inputs``: projection -> (config name, input width)."""
        bits = [int(b) for b in (bits if isinstance(bits, (list, tuple)) else [bits] * self.num_experts)]
        if len(bits) != self.num_experts or any(b not in BITS for b in bits):
            raise ValueError(f"bits must be {self.num_experts} values from {BITS}, got {bits}")
        # one group size per projection stack (FineQuant's adaptive choice), else the layer's ``group_size``: the
        # scales of a stack [n, K/g, N, 2] share one shape, so the choice is per stack, not per expert
        groups = {**dict.fromkeys(shapes, group_size), **(group_sizes or {})}
        if set(groups) != set(shapes):
            raise ValueError(f"group_sizes has the keys {' and '.join(map(repr, shapes))}, got {sorted(group_sizes)}")
        for proj, g in groups.items():
            name, k = inputs[proj]
            if not isinstance(g, int) or g % 32 or g < 32:
                raise ValueError(f"group_size must be a positive multiple of 32, got {g}")
            if k % g and min(bits) < 8:  # int8 is per output channel: only 2/3/4 bits have groups
                raise ValueError(f"group_size must be a multiple of 32 dividing {name}={k}, got {g}")
        self.bits, self.group_size, self.groups, self.shapes = bits, group_size, groups, shapes
        self.widths = sorted(set(bits))
        self.slot = [bits[:e].count(b) for e, b in enumerate(bits)]  # expert e's position in its width's stack
        for b in self.widths:
            count = bits.count(b)
            for proj, (n, k) in shapes.items():
                if b == 8:
                    self.register_buffer(f"{proj}_int8", torch.zeros(count, n, k, dtype=torch.int8))
                    self.register_buffer(f"{proj}_int8_scale", torch.ones(count, n))
                else:
                    self.register_buffer(f"{proj}_int{b}", torch.zeros(count, n, k * b // 8, dtype=torch.uint8))
                    self.register_buffer(f"{proj}_int{b}_scale_zero",
                                         torch.zeros(count, k // groups[proj], n, 2, dtype=torch.bfloat16))
        # index tables for the compiled gather path (not saved: ``bits`` rebuilds them)
        self.register_buffer("width_of", torch.tensor(bits), persistent=False)
        self.register_buffer("slot_of", torch.tensor(self.slot), persistent=False)
        self._kernel_cache: dict = {}  # (proj, bits) -> int4-pack stack of 2/3-bit weights, built on first use
        self.register_load_state_dict_post_hook(lambda module, keys: module._kernel_cache.clear())

    @torch.no_grad()
    def _quantize_from(self, weights: dict, symmetric: bool) -> None:
        """Fill the stacks from dense weights ``{proj: [E, N, K]}``, each expert at its own width."""
        for e, b in enumerate(self.bits):
            for proj in self.shapes:
                weight = weights[proj][e]
                g = self.groups[proj]
                q, s = quantize_int8(weight) if b == 8 else quantize_grouped(weight, g, b, symmetric)[:2]
                stored, scale = self.stored(proj, b)
                stored[self.slot[e]].copy_(q)
                scale[self.slot[e]].copy_(s)

    def _init_tables(self) -> None:
        """Rebuild the index tables (never saved); packed weights and their scales cannot be initialised
        meaningfully, so a load that lacks one fails with its name."""
        self.width_of.copy_(torch.tensor(self.bits))
        self.slot_of.copy_(torch.tensor(self.slot))
        refuse_missing(self, [n for n, _ in self.named_buffers(recurse=False)])

    def _group_options(self) -> dict:
        opts = {"bits": list(self.bits), "group_size": self.group_size}
        if len(set(self.groups.values())) > 1 or next(iter(self.groups.values())) != self.group_size:
            opts["group_sizes"] = dict(self.groups)  # recorded only where it differs (older layouts stay as they were)
        return opts

    def group_of(self, proj: str) -> int:
        return self.groups[proj]

    def stored(self, proj: str, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stacked packed weights of one width and their scales (scale/zero below 8 bits)."""
        suffix = "scale" if bits == 8 else "scale_zero"
        return getattr(self, f"{proj}_int{bits}"), getattr(self, f"{proj}_int{bits}_{suffix}")

    def dequantized(self, e: int) -> tuple[torch.Tensor, ...]:
        """Expert e's weights in float, one per projection in ``self.shapes`` order: the reference."""
        b, j = self.bits[e], self.slot[e]
        return tuple(dequantize(b, self.stored(p, b)[0][j], self.stored(p, b)[1][j], self.shapes[p], self.groups[p])
                     for p in self.shapes)

    def _apply(self, fn, *args, **kwargs):
        self._kernel_cache.clear()  # .to() / .bfloat16() move the stored weights: rebuild from them
        return super()._apply(fn, *args, **kwargs)

    def kernel_stack(self, proj: str, bits: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(weights, scales, kernel width) as the kernels read them: 2/3-bit stacks run on the int4 kernel."""
        q, scale = self.stored(proj, bits)
        if bits not in (2, 3):
            return q, scale, bits
        if f"{proj}_int{bits}_as_int4" in self._buffers:  # registered while a decode step is exported
            return self._buffers[f"{proj}_int{bits}_as_int4"], scale, 4
        if (proj, bits) not in self._kernel_cache:
            k = self.shapes[proj][1]
            self._kernel_cache[proj, bits] = torch.stack([int4_pack(bits, w, k) for w in q]) if len(q) else q
        return self._kernel_cache[proj, bits], scale, 4

    def working_copies(self) -> dict:
        """The int4 working copies built so far, by the buffer names they take while a decode step is exported
        (``zoo.runtime.decode_aot``: so the compiled step reads them as it reads the stored weights)."""
        return {f"{proj}_int{bits}_as_int4": t for (proj, bits), t in self._kernel_cache.items()}

    def read_stack(self, proj: str, bits: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(weights, scales, width) as a call reads them now: the stored codes where ``kernels.reads_stored_codes``
        (no working copy is built; past the kernel, a long prompt, each selected expert is dequantised for the call),
        else ``kernel_stack``'s."""
        return self.stored(proj, bits) + (bits,) if kernels.reads_stored_codes(bits) else self.kernel_stack(proj, bits)

    def _linear(self, x, proj: str, bits: int, slot):
        q, scale, kernel_bits = self.read_stack(proj, bits)
        return lowbit_linear(x, pick(q, slot), pick(scale, slot), kernel_bits, self.groups[proj], self.shapes[proj])

    def slot_maps(self) -> dict:
        """Per width, expert -> slot in that width's stack (-1: stored at another width); None for one width."""
        if len(self.widths) == 1:
            return {self.widths[0]: None}
        return {b: torch.where(self.width_of == b, self.slot_of, -1) for b in self.widths}

    def _eager_pairs(self, hidden, stacks) -> int | None:
        """An eager call's kernel limit where some width is read as stored (``kernels.stored_pairs``; with mixed
        widths the least of every width's), else None (``kernels.PAIRS_PER_EXPERT``'s)."""
        stored = [kernels.stored_pairs(b) for b in self.widths]
        if all(limit is None for limit in stored):
            return None
        default = kernels.PAIRS_PER_EXPERT[kernels.eager_pairs_key(hidden, *(t for st in stacks for t in st[:4]),
                                                                   packed=True)]
        return min(default if limit is None else limit for limit in stored)

    def _reads_stored_codes(self) -> bool:
        """Whether the kernel reads some width's 2/3-bit codes as stored (no int4 working copy is built for them,
        so a compiled step takes the kernel whatever its token count rather than torch's int4 path on a copy)."""
        return any(kernels.reads_stored_codes(b) for b in self.widths)

    def _kernel_stacks(self) -> list:
        """Per width, ``kernels.expert_block``'s ``(first, first scale, down, down scale, bits, groups, slots)``.
        Called eagerly first (the prefill), which builds any int4 working copy: never built inside a compiled step."""
        first, second = self.shapes  # the projection into the intermediate channels, then down
        # 2/3-bit experts read their int4 working copy where that is faster (an AVX-512 machine read 2/3-bit codes at
        # ~2.3 GB/s of packed bytes, fewer weights per second than int4's ~11 GB/s), their own codes where
        # kernels.STORED_CODES measured those as fast or faster (2-bit with 8-bit inputs on the avx2 set, 2-bit on
        # the avx512-bf16 set), or every width with kernels.stored_codes(True): no copy
        maps, groups = self.slot_maps(), (self.groups[first], self.groups[second])
        return [self.read_stack(first, b)[:2] + self.read_stack(second, b) + (groups, maps[b]) for b in self.widths]

    def _forward_gather(self, hidden, routing):
        """Compiled training on few tokens: for each (token, slot) pick the selected expert's packed weights
        by index (a gather, no host sync, and differentiable in the input); with mixed widths every width is
        computed and masked to its own experts."""
        idx, valid = gather_rows(routing.indices, self.num_experts)
        k = routing.indices.shape[1]
        w = torch.where(valid, routing.weights.reshape(-1), 0)
        outs = []
        for s in range(idx.shape[0]):  # T * k <= E slots, a static count
            x = hidden[s // k: s // k + 1]
            e, y = idx[s], 0
            for b in self.widths:
                slot = pick(self.slot_of, e).clamp(max=self.bits.count(b) - 1)  # in range even when masked out
                y_b = self._expert_at(b, slot, x, e)
                y = y_b if len(self.widths) == 1 else y + torch.where(pick(self.width_of, e) == b, y_b, 0)
            outs.append(y * w[s].to(y.dtype))
        return torch.cat(outs).view(hidden.shape[0], k, -1).sum(1).to(hidden.dtype)


class QuantizedExperts(PackedStacks, SwiGLUExperts):
    """SwiGLU experts with packed low-bit weights; ``bits`` gives each expert's width (2, 3, 4 or 8).

    Experts of one width are stacked, e.g. ``gate_up_int8 [n8, 2I, H]`` with ``gate_up_int8_scale [n8, 2I]``
    and ``gate_up_int4 [n4, 2I, H/2]`` with ``gate_up_int4_scale_zero [n4, H/g, 2I, 2]``, so one expert is
    a view (eager prefill) and the selected ones are a gather (compiled decode, no host sync).
    """

    name = "quantized"
    summary = "Weight-only packed 2/3/4/8-bit experts on torch's CPU int4/int8 kernels, mixed widths per expert."
    card = "cards/quantize.md"
    space = "compression-lab"

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, bits, group_size: int = 64,
                 activation: str = "silu", bias: bool = False, swiglu_limit: float = 7.0, swiglu_alpha: float = 1.702,
                 group_sizes: dict | None = None):
        torch.nn.Module.__init__(self)
        from zoo.moe.experts import ACTIVATIONS

        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self._build_stacks(bits, group_size, group_sizes,
                           {"gate_up": (2 * intermediate_size, hidden_size), "down": (hidden_size, intermediate_size)},
                           {"gate_up": ("hidden_size", hidden_size), "down": ("intermediate_size", intermediate_size)})
        self.activation, self.swiglu_limit, self.swiglu_alpha = activation, swiglu_limit, swiglu_alpha
        self._act = ACTIVATIONS[activation]
        self.gate_up_proj_bias = torch.nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size)) if bias else None
        self.down_proj_bias = torch.nn.Parameter(torch.zeros(num_experts, hidden_size)) if bias else None

    @classmethod
    @torch.no_grad()
    def from_dense(cls, experts: SwiGLUExperts, bits, group_size: int = 64,
                   group_sizes: dict | None = None, symmetric: bool = False) -> QuantizedExperts:
        """``symmetric``: the 2/3/4-bit experts as ``w = q s`` (``quantize_symmetric``); int8 is symmetric anyway."""
        new = cls(bits=bits, group_size=group_size, group_sizes=group_sizes, **experts.options())
        new._quantize_from({"gate_up": experts.gate_up_proj, "down": experts.down_proj}, symmetric)
        for name in ("gate_up_proj_bias", "down_proj_bias"):
            if getattr(experts, name) is not None:
                getattr(new, name).copy_(getattr(experts, name))
        return new

    def init_weights(self, std: float) -> None:
        """Rebuild the index tables (never saved); packed weights and their scales cannot be initialised
        meaningfully, so a load that lacks one fails with its name. Missing biases start at zero."""
        self._init_tables()
        for bias in (self.gate_up_proj_bias, self.down_proj_bias):
            if bias is not None:
                init.zeros_(bias)

    def options(self) -> dict:
        return {**super().options(), **self._group_options()}

    def _expert_at(self, bits: int, slot, x: torch.Tensor, e) -> torch.Tensor:
        h = self._linear(x, "gate_up", bits, slot)
        if self.gate_up_proj_bias is not None:
            h = h + pick(self.gate_up_proj_bias, e)
        y = self._linear(self.glu(h), "down", bits, slot)
        return y if self.down_proj_bias is None else y + pick(self.down_proj_bias, e)

    def forward(self, hidden, routing):
        tokens, k = routing.indices.shape
        if torch.compiler.is_compiling():
            # Compiled inference reads the packed experts in place (zoo.moe.in_place; faster than gathering
            # them, most for int8); compiled training on few tokens gathers (the op has no autograd).
            if not torch.is_grad_enabled():
                return self._forward_in_place(hidden, routing)
            if tokens * k <= self.num_experts:
                return self._forward_gather(hidden, routing)
        kernels.load()  # prefill dequantises int4 with the zoo's kernel (built once per machine, then cached)
        stacks = self._kernel_stacks()  # few tokens (a short prompt, an eager step): the kernel reads them in place
        if (use_kernel(hidden, routing, self.num_experts, *(t for st in stacks for t in st[:4]), packed=True,
                       pairs=self._eager_pairs(hidden, stacks))
                or self._prefill_on_int8_dots(hidden, routing, stacks)):
            return self._forward_kernel(hidden, routing, stacks)
        return self._forward_sorted(hidden, routing)

    def _forward_kernel(self, hidden, routing, stacks=None):
        """The routed tokens on ``zoo::moe_gemv``, every width read from its kernel stack (``_kernel_stacks``)."""
        stacks = self._kernel_stacks() if stacks is None else stacks
        return kernels.expert_block(hidden, routing.indices, routing.weights, stacks, self.num_experts, self.glu,
                                    self.gate_up_proj_bias, self.down_proj_bias)

    def _prefill_on_int8_dots(self, hidden, routing, stacks) -> bool:
        """Whether int4 or int8 experts' prefill runs on the kernel with 8-bit inputs (``kernels.int8_inputs(True)``,
        on the set that has int8 dot products), rounded as in decode: up to ``kernels.INT4_DOT_PAIRS`` /
        ``INT8_DOT_PAIRS`` (``INT8_DOT_PAIRS_AVX2``) (token, slot) pairs per selected expert on average, where it beats
        the exact path (dequantised dense matmuls; int8 with VNNI: torch's int8 ones). One width only: mixed widths were
        not measured."""
        limit = kernels.int8_dot_limit("experts", self.widths[0], hidden.dtype) if self.widths in ([4], [8]) else None
        if not (limit and kernels.int8_inputs_on() and kernels.isa() in kernels.INT8_DOT_ISAS
                and not torch.is_grad_enabled() and hidden.device.type == "cpu"
                and hidden.dtype in (torch.float32, torch.bfloat16)
                and all(t.is_contiguous() for st in stacks for t in st[:4])):
            return False
        chosen, selected = chosen_pairs(routing.indices, self.num_experts)
        return chosen <= limit * max(1, selected)

    def _forward_in_place(self, hidden, routing):
        """The routed tokens through the zoo's kernel (``zoo::moe_gemv``, every width read in its stored form)
        where it is loaded, else ``zoo::lowbit_experts``, which slices each selected expert's packed weights
        as views for torch's kernels; both are opaque to the compiler, so the compiled step stays one graph."""
        stacks = self._kernel_stacks()
        if use_kernel(hidden, routing, self.num_experts, *(t for st in stacks for t in st[:4]), packed=True,
                      any_count=self._reads_stored_codes()):
            return self._forward_kernel(hidden, routing, stacks)
        return lowbit_experts(*self.in_place_args(hidden, routing))

    def in_place_args(self, hidden, routing) -> tuple:
        """The arguments of ``zoo::lowbit_experts`` for these experts and this routing."""
        stacks, kernel_bits = [], []
        for b in self.widths:  # the 2/3-bit kernel stacks were built by the eager prefill
            (gq, gs, kb), (dq, ds, _) = self.kernel_stack("gate_up", b), self.kernel_stack("down", b)
            stacks += [gq, gs, dq, ds]
            kernel_bits.append(kb)
        return (hidden, routing.indices, routing.weights, stacks, list(self.widths), kernel_bits, self.width_of,
                self.slot_of, self.group_size, self.gate_up_proj_bias, self.down_proj_bias, self.activation,
                float(self.swiglu_limit), float(self.swiglu_alpha))

    def num_parameters(self) -> int:
        """Weights represented (as for dense experts); ``nbytes`` is what they really take."""
        n = self.num_experts * 3 * self.hidden_size * self.intermediate_size
        return n + sum(p.numel() for p in (self.gate_up_proj_bias, self.down_proj_bias) if p is not None)


class QuantizedMLPExperts(PackedStacks, MLPExperts):
    """Ungated experts (``mlp``: Nemotron-H, Switch Transformers) with packed low-bit weights, quantized exactly as
    ``QuantizedExperts`` quantizes gated ones (the same codes, scales, widths per expert and group sizes per
    projection), stacked as ``up_int8 [n8, I, H]`` / ``down_int8 [n8, H, I]`` and so on.

    Which path runs: eager calls (prefill, training) run each expert's two projections on torch's int8/int4 kernels
    (``lowbit_linear``, gradients to the input through the dequantized weight); a compiled inference step on few
    tokens runs ``zoo::moe_gemv`` where the zoo's kernel is loaded (the gated block with the plain activation in
    place of the gated one); other compiled steps on few tokens gather the selected experts' packed weights.
    ``zoo::lowbit_experts`` (the in-place fallback of the gated kind) has no ungated form: without the zoo's
    kernel, compiled inference takes the gather or sorted path instead.
    """

    name = "quantized-mlp"
    summary = "Ungated experts with packed 2/3/4/8-bit weights on torch's CPU int4/int8 kernels, mixed widths."
    card = "cards/quantize.md"
    space = "compression-lab"

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, bits, group_size: int = 64,
                 activation: str = "relu2", group_sizes: dict | None = None):
        torch.nn.Module.__init__(self)
        if not isinstance(activation, str) or activation not in ACT2FN:
            raise ValueError(f"unknown activation {activation!r}")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self._build_stacks(bits, group_size, group_sizes,
                           {"up": (intermediate_size, hidden_size), "down": (hidden_size, intermediate_size)},
                           {"up": ("hidden_size", hidden_size), "down": ("intermediate_size", intermediate_size)})
        self.activation, self._act = activation, ACT2FN[activation]

    @classmethod
    @torch.no_grad()
    def from_dense(cls, experts: MLPExperts, bits, group_size: int = 64, group_sizes: dict | None = None,
                   symmetric: bool = False) -> QuantizedMLPExperts:
        """``symmetric``: the 2/3/4-bit experts as ``w = q s`` (``quantize_symmetric``); int8 is symmetric anyway."""
        new = cls(bits=bits, group_size=group_size, group_sizes=group_sizes, **experts.options())
        new._quantize_from({"up": experts.up_proj, "down": experts.down_proj}, symmetric)
        return new

    def init_weights(self, std: float) -> None:
        """Rebuild the index tables; a load that lacks a packed weight or scale fails with its name."""
        self._init_tables()

    def options(self) -> dict:
        return {**super().options(), **self._group_options()}

    def _expert_at(self, bits: int, slot, x: torch.Tensor, e) -> torch.Tensor:
        return self._linear(self._act(self._linear(x, "up", bits, slot)), "down", bits, slot)

    def forward(self, hidden, routing):
        tokens, k = routing.indices.shape
        if torch.compiler.is_compiling():
            if not torch.is_grad_enabled():
                stacks = self._kernel_stacks()
                if use_kernel(hidden, routing, self.num_experts, *(t for st in stacks for t in st[:4]), packed=True,
                              any_count=self._reads_stored_codes()):
                    return kernels.expert_block(hidden, routing.indices, routing.weights, stacks, self.num_experts,
                                                self._act)
            if tokens * k <= self.num_experts:
                return self._forward_gather(hidden, routing)
        kernels.load()  # prefill dequantises int4 with the zoo's kernel (built once per machine, then cached)
        stacks = self._kernel_stacks()  # few tokens (a short prompt, an eager step): the kernel reads them in place
        if use_kernel(hidden, routing, self.num_experts, *(t for st in stacks for t in st[:4]), packed=True,
                      pairs=self._eager_pairs(hidden, stacks)):
            return kernels.expert_block(hidden, routing.indices, routing.weights, stacks, self.num_experts, self._act)
        return run_sorted(hidden, routing.indices, routing.weights, self.num_experts, self.expert)

    def num_parameters(self) -> int:
        """Weights represented (as for dense experts); ``nbytes`` is what they really take."""
        return self.num_experts * 2 * self.hidden_size * self.intermediate_size
