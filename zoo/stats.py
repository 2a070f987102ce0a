"""Per-expert statistics gathered on calibration data (what pruning and merging methods decide from)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from zoo.layout import moe_layers


@dataclass
class ExpertStats:
    layer: int
    counts: torch.Tensor  # [E] routed (token, slot) pairs per expert
    gate_sum: torch.Tensor  # [E] sum of routing weights
    reap_sum: torch.Tensor  # [E] sum over routed tokens of gate * ||expert output||_2
    output_sum: torch.Tensor | None  # [E, H] sum over *all* tokens of the expert's output (HC-SMoE)
    tokens: int = 0

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
def collect(model, batches, all_outputs: bool = False, desc: str = "calibrating") -> list[ExpertStats]:
    """Run ``batches`` through ``model`` and record, per MoE layer, how each expert is used."""
    layers = moe_layers(model)
    stats = [ExpertStats(i, torch.zeros(m.num_experts, dtype=torch.long), torch.zeros(m.num_experts, dtype=torch.float64),
                         torch.zeros(m.num_experts, dtype=torch.float64),
                         torch.zeros(m.num_experts, m.router.hidden_size, dtype=torch.float64) if all_outputs else None)
             for i, m in layers]
    handles = []
    for st, (_, moe) in zip(stats, layers):
        def hook(router, args, routing, st=st, moe=moe):
            x = args[0]
            st.tokens += x.shape[0]
            n = moe.num_experts
            for e in range(n):
                tok, slot = (routing.indices == e).nonzero(as_tuple=True)
                if all_outputs:
                    out = moe.experts.expert(e, x).double()
                    st.output_sum[e] += out.sum(0)
                    routed = out[tok]
                elif len(tok):
                    routed = moe.experts.expert(e, x[tok]).double()
                if len(tok):
                    g = routing.weights[tok, slot].double()
                    st.counts[e] += len(tok)
                    st.gate_sum[e] += g.sum()
                    st.reap_sum[e] += (g * routed.norm(dim=-1)).sum()
        handles.append(moe.router.register_forward_hook(hook))
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
