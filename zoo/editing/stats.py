"""Per-expert statistics gathered on calibration data (what pruning and merging methods decide from)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from zoo.moe.layout import moe_layers
from zoo.moe.experts import SwiGLUExperts


@dataclass
class ExpertStats:
    layer: int
    counts: torch.Tensor  # [E] routed (token, slot) pairs per expert
    gate_sum: torch.Tensor  # [E] sum of routing weights
    reap_sum: torch.Tensor  # [E] sum over routed tokens of gate * ||expert output||_2
    output_sum: torch.Tensor | None  # [E, H] sum of each expert's output over *all* tokens (all_outputs=True): what
    # methods that compare experts by their outputs read
    tokens: int = 0

    @classmethod
    def empty(cls, layer: int, moe, all_outputs: bool = False, device=None) -> ExpertStats:
        """Zero sums on ``device`` (that of the tokens they will count; default the CPU)."""
        n, h = moe.num_experts, moe.router.hidden_size
        zeros = functools.partial(torch.zeros, dtype=torch.float64, device=device)
        return cls(layer, torch.zeros(n, dtype=torch.long, device=device), zeros(n), zeros(n),
                   zeros(n, h) if all_outputs else None)

    @property
    def frequency(self) -> torch.Tensor:
        return self.counts.double() / max(1, self.tokens)

    @property
    def reap(self) -> torch.Tensor:
        """REAP saliency: mean over the tokens routed to e of gate * ||f_e(x)|| (0 for unused experts)."""
        return self.reap_sum.double() / self.counts.clamp(min=1).double()

    @property
    def mean_output(self) -> torch.Tensor:
        return self.output_sum / max(1, self.tokens)

    @torch.no_grad()
    def add(self, moe, x: torch.Tensor, routing=None) -> ExpertStats:
        """Accumulate tokens ``x [T, H]`` entering ``moe`` (routed here unless ``routing`` is given)."""
        routing = moe.route(x) if routing is None else routing
        self.tokens += x.shape[0]
        x = moe.expert_inputs(x)  # the router reads the block's input, the experts (Gemma 4) a normed copy
        for e in range(moe.num_experts):
            tok, slot = (routing.indices == e).nonzero(as_tuple=True)
            if self.output_sum is not None:
                out = block_expert_output(moe, e, x)
                self.output_sum[e] += out.sum(0)
                routed = out[tok]
            elif len(tok):
                routed = block_expert_output(moe, e, x[tok])
            if len(tok):
                g = routing.weights[tok, slot].double()
                self.counts[e] += len(tok)
                self.gate_sum[e] += g.sum()
                self.reap_sum[e] += (g * routed.norm(dim=-1)).sum()
        return self


def block_expert_output(moe, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert e's output on expert inputs ``x`` as the block adds it before its routing weight, in float64: through
    the block's expert-output norm and output projection where it has them (Muse Spark's latent experts), so a
    saliency or an output comparison reads what reaches the model."""
    out = expert_output(moe.experts, e, x)
    norm, proj = getattr(moe, "expert_output_norm", None), getattr(moe, "output_proj", None)
    if norm is not None:
        out = norm(out.to(norm.weight.dtype)).double()
    if proj is not None:
        out = F.linear(out, proj.weight.double())
    return out


def expert_output(experts, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert e's output on ``x`` in float64, for statistics. Half-precision dense experts are computed in fp32
    from an upcast copy of that one expert's weights: more exact than bf16 arithmetic, and on CPUs without native
    bf16 matmuls (AVX2) about 8x faster (measured: 7 against 65 GFLOP/s a thread)."""
    if type(experts) is SwiGLUExperts and experts.gate_up_proj.dtype in (torch.bfloat16, torch.float16):
        b1 = None if experts.gate_up_proj_bias is None else experts.gate_up_proj_bias[e].float()
        b2 = None if experts.down_proj_bias is None else experts.down_proj_bias[e].float()
        h = experts.glu(F.linear(x.float(), experts.gate_up_proj[e].float(), b1))
        return F.linear(h, experts.down_proj[e].float(), b2).double()
    return experts.expert(e, x).double()


def layer_stats(layer: int, moe, x: torch.Tensor, all_outputs: bool = False, chunk: int = 1024) -> ExpertStats:
    """Statistics of one MoE block on its calibration inputs ``x [T, H]`` (taken in chunks of tokens). Under a
    process group every rank holds all of ``x``, works on its slice of the tokens, and the sums are added up
    (``zoo.editing.distributed``): the statistics' declared reduction is a sum. Each chunk is routed in the routing
    context of its own rows (token ids, a carried router state)."""
    from zoo.editing import distributed
    from zoo.moe.context import routing_context, row_parts

    st = ExpertStats.empty(layer, moe, all_outputs, device=x.device)
    for part, ctx in row_parts(distributed.my_rows(x), chunk, distributed.my_rows_start(x.shape[0])):
        with routing_context(ctx):
            st.add(moe, part)
    distributed.all_reduce_sum(st.counts, st.gate_sum, st.reap_sum, st.output_sum)
    st.tokens = x.shape[0]
    return st


@torch.no_grad()
def collect(model, batches, all_outputs: bool = False, desc: str = "calibrating") -> list[ExpertStats]:
    """Run ``batches`` through the whole ``model`` and record, per MoE layer, how each expert is used (all layers
    see the original model's hidden states; compressors use the layer-at-a-time ``zoo.editing.layerwise`` instead)."""
    layers = moe_layers(model)
    stats = [ExpertStats.empty(i, m, all_outputs, device=next(m.parameters()).device) for i, m in layers]
    def recorder(st, moe):
        def record(router, args, routing):  # returns None: the router's output goes on unchanged
            st.add(moe, args[0], routing)
        return record

    handles = [moe.router.register_forward_hook(recorder(st, moe)) for st, (_, moe) in zip(stats, layers)]
    was_training = model.training
    model.eval()
    try:
        for ids in tqdm(batches, desc=desc, leave=False):
            model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return stats
