"""prune-group: REAP (or frequency) pruning restricted to one modality's expert group.

Calibration runs multimodal batches (dicts of ``zoo_mm`` inputs) through the model; inside the chosen
group each expert is scored by REAP saliency (mean over its routed tokens of gate x ||expert output||)
or by how often it is routed to. The group keeps its ``num_experts`` best; every other group, the group
gate and the kept experts' router rows are unchanged, so routing among survivors is too.
"""
from __future__ import annotations

import torch

from zoo import Compressor
from zoo.moe.layout import moe_layers, replace_blocks
from zoo.moe import SparseMoE
from zoo_multimodal.hierarchical_modality import HierarchicalModality
from zoo_multimodal.modality_groups import ModalityGroupExperts
from zoo.components.controls import Control

SCORES = ("reap", "frequency")


class PruneGroup(Compressor):
    name = "prune-group"
    summary = "Prune experts inside one modality group only (REAP or frequency scores on multimodal calibration)."
    paper = ("Lasby et al., REAP the Experts, 2025, arXiv:2510.13999, applied within MoHAVE's modality groups "
             "(Kim et al., ICML 2025)")
    card = "cards/prune-group.md"
    space = "multimodal-digits"
    needs_calibration = True

    @classmethod
    def demo_controls(cls, model=None):
        return [Control("group", "choice", "vision", choices=("text", "vision", "audio"), help="the modality group"),
                Control("num_experts", "int", 2, low=1, high=64, step=1, help="experts kept in that group"),
                Control("score", "choice", "reap", choices=SCORES, help="expert saliency")]

    @classmethod
    def demo_presets(cls, model=None):
        return {"mild": {"group": "vision", "num_experts": 3}, "strong": {"group": "vision", "num_experts": 2}}

    @classmethod
    def demo_unfit(cls, model):
        from zoo.moe.layout import moe_layers

        kinds = {moe.experts.name for _, moe in moe_layers(model)}
        if kinds == {"modality-groups"}:
            return ""
        return (f"prune-group prunes one modality group of modality-groups experts; this model's experts are "
                f"{', '.join(sorted(kinds)) or 'none'} (see the multimodal-digits Space)")

    def __init__(self, group: str, num_experts: int, score: str = "reap"):
        if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
            raise ValueError(f"num_experts must be a positive integer, got {num_experts!r}")
        if score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {score!r}")
        super().__init__(group=group, num_experts=num_experts, score=score)
        self.group, self.num_experts, self.score = str(group), num_experts, score
        self.results: dict = {}

    def check_model(self, model) -> list[tuple[int, SparseMoE]]:
        layers = moe_layers(model)
        for i, moe in layers:
            if not isinstance(moe.experts, ModalityGroupExperts) or not isinstance(moe.router, HierarchicalModality):
                raise TypeError(f"layer {i} is not modality-groups experts under a hierarchical-modality router")
            if self.group not in moe.experts.groups:
                raise ValueError(f"layer {i} has no group {self.group!r} (groups: {moe.experts.groups})")
            size = len(moe.experts.group_range(self.group))
            if self.num_experts > size:
                raise ValueError(f"num_experts={self.num_experts} but group {self.group!r} of layer {i} has {size}")
            per_group = moe.router.top_k // moe.router.top_groups
            if self.num_experts < per_group:
                raise ValueError(f"the router picks {per_group} experts per group; keep at least that many")
        return layers

    def compress(self, model, calibration=None):
        layers = self.check_model(model)
        if calibration is not None and not all(isinstance(b, dict) for b in calibration):
            raise ValueError("prune-group calibrates on zoo_mm batches (dicts of input_ids, pixel_values, "
                             "audio_features, ... from zoo_multimodal.dataset.batch), not token ids alone")
        if calibration is None:
            from zoo_multimodal.dataset import calibration_batches

            calibration = calibration_batches(model)
        scores = self.statistics(model, layers, calibration)
        new = {}
        for (i, moe), score in zip(layers, scores):
            members = list(moe.experts.group_range(self.group))
            best = sorted(members[j] for j in score[members].double().argsort(descending=True, stable=True)
                          [: self.num_experts].tolist())
            self.results.setdefault("kept", {})[str(i)] = best
            keep = [e for e in range(moe.num_experts) if e not in members or e in best]
            new[i] = keep_group_experts(moe, keep, self.group, self.num_experts)
        replace_blocks(model, new)  # only when every layer succeeded
        return model

    @torch.no_grad()
    def statistics(self, model, layers, batches) -> list[torch.Tensor]:
        """Per layer, a score per expert (only the chosen group's are used)."""
        sums = [torch.zeros(moe.num_experts, dtype=torch.float64) for _, moe in layers]
        counts = [torch.zeros(moe.num_experts, dtype=torch.float64) for _, moe in layers]

        def hook(module, args, out, j):
            hidden, routing = args
            for e in module.group_range(self.group):
                tok, slot = (routing.indices == e).nonzero(as_tuple=True)
                counts[j][e] += len(tok)
                if len(tok):
                    y = module.expert(e, hidden[tok])
                    sums[j][e] += (routing.weights[tok, slot].double() * y.double().norm(dim=-1)).sum()

        handles = [moe.experts.register_forward_hook(lambda m, a, o, j=j: hook(m, a, o, j))
                   for j, (_, moe) in enumerate(layers)]
        try:
            model.eval()
            for inputs in batches:
                model(**{k: v for k, v in inputs.items() if k != "labels"})
        finally:
            for h in handles:
                h.remove()
        return [c if self.score == "frequency" else s / c.clamp(min=1) for s, c in zip(sums, counts)]


@torch.no_grad()
def keep_group_experts(moe: SparseMoE, keep: list[int], group: str, size: int) -> SparseMoE:
    """A SparseMoE with experts ``keep`` (group ``group`` now of ``size``); router rows come along."""
    old_e, old_r = moe.experts, moe.router
    sizes = [size if g == group else n for g, n in zip(old_e.groups, old_e.group_sizes)]
    opts = {k: v for k, v in old_e.options().items() if k not in ("num_experts", "group_sizes")}
    experts = ModalityGroupExperts(sizes, **opts).to(old_e.gate_up_proj.device, old_e.gate_up_proj.dtype)
    rows = torch.tensor(keep)
    for name, p in old_e.named_parameters():
        getattr(experts, name).copy_(p.index_select(0, rows))
    ropts = {k: v for k, v in old_r.options.items() if k != "group_sizes"}
    router = HierarchicalModality(old_r.hidden_size, len(keep), old_r.top_k, group_sizes=sizes, **ropts)
    router.to(old_r.weight.device, old_r.weight.dtype)
    router.weight.copy_(old_r.weight.index_select(0, rows))
    router.group_weight.copy_(old_r.group_weight)
    if old_r.bias is not None:
        router.bias.copy_(old_r.bias.index_select(0, rows))
    return moe.with_parts(router, experts)
