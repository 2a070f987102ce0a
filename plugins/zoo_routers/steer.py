"""steer: Mixture of Tunable Experts (MoTE). The layer's own selection rule (softmax top-k, or DeepSeek-V3's
sigmoid + bias with group-limited top-k), except that disabled experts are never selected and forced experts
always are (they take the slots of the weakest others). Weights are the base rule's gate values."""
import torch
import torch.nn.functional as F
from torch import nn

from zoo.moe import Router, Routing
from zoo.components.controls import Control, layer_experts

BASES = ("topk-softmax", "sigmoid-bias")


def per_layer(value, label: str) -> dict[str, list[int]]:
    """``{layer: [experts]}`` (keys may be strings, as after a JSON round trip) -> ``{"layer": sorted ids}``."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"{label} must be a mapping {{layer: [experts]}}, got {type(value).__name__}")
    out = {}
    for layer, experts in value.items():
        experts = [experts] if isinstance(experts, int) else experts
        if not (isinstance(layer, (int, str)) and str(layer).isdigit() and isinstance(experts, (list, tuple))
                and all(isinstance(e, int) and not isinstance(e, bool) for e in experts)):
            raise ValueError(f"{label} maps a layer index to a list of expert ids, got {layer!r}: {experts!r}")
        out[str(int(layer))] = sorted(set(experts))
    return out


def _fill(scores, experts: tuple, value: float):
    """``scores [T, E]`` with the columns of ``experts`` set to ``value`` (a static choice: no host sync)."""
    if not experts:
        return scores
    return scores.index_fill(1, torch.tensor(experts, device=scores.device), value)


class Steer(Router):
    name = "steer"
    summary = "Mixture of Tunable Experts: the base routing, with chosen experts switched off or forced on per layer."
    paper = ("Dahlke et al., Mixture of Tunable Experts - Behavior Modification of DeepSeek-R1 at Inference "
             "Time, 2025. arXiv:2502.11096")
    card = "cards/steer.md"
    space = "router-explorer"

    @classmethod
    def demo_controls(cls, model=None):
        mild = cls.demo_presets(model)["mild"]["disable"]
        top_k = super().demo_controls(model)[0]  # k + disabled experts fit in the layer
        return [top_k.with_range(high=max(1, (layer_experts(model) or 8) - max(map(len, mild.values()), default=0))),
                Control("disable", "json", mild,
                        help='experts switched off, per MoE layer: {"layer": [experts]}'),
                Control("force", "json", None, optional=True,
                        help='experts always on, per MoE layer: {"layer": [experts]}')]

    @classmethod
    def demo_presets(cls, model=None):
        """mild: the first quarter of each MoE layer's experts off; strong: the first half (always leaving k)."""
        from zoo.moe.layout import moe_layers

        layers = [(i, moe.num_experts, moe.top_k) for i, moe in moe_layers(model)] if model is not None else \
            [(0, 8, 2)]
        return {strength: {"disable": {str(i): list(range(min(max(1, round(n * share)), n - k)))
                                       for i, n, k in layers if n > k}}
                for strength, share in (("mild", 0.25), ("strong", 0.5))}

    def __init__(self, hidden_size, num_experts, top_k, disable=None, force=None, layer: int | None = None,
                 base: str = "topk-softmax", norm_topk_prob: bool = True, n_group: int | None = None,
                 topk_group: int | None = None, routed_scaling_factor: float | None = None, **options):
        if base not in BASES:
            raise ValueError(f"steer modifies {' or '.join(BASES)} routing; this layer's router is {base!r}")
        disable, force = per_layer(disable, "disable"), per_layer(force, "force")
        off, on = self._validate(num_experts, top_k, layer, disable, force)
        sigmoid = base == "sigmoid-bias"
        if not sigmoid and (n_group, topk_group, routed_scaling_factor) != (None, None, None):
            raise ValueError("n_group, topk_group and routed_scaling_factor apply to a sigmoid-bias base only")
        n_group, topk_group = (n_group or 1, topk_group or 1) if sigmoid else (None, None)
        if sigmoid and (num_experts % n_group or not 1 <= topk_group <= n_group):
            raise ValueError(f"bad groups for {num_experts} experts: n_group={n_group}, topk_group={topk_group}")
        scale = (1.0 if routed_scaling_factor is None else float(routed_scaling_factor)) if sigmoid else None
        group_opts = {"n_group": n_group, "topk_group": topk_group, "routed_scaling_factor": scale} if sigmoid else {}
        super().__init__(hidden_size, num_experts, top_k, disable=disable, force=force, layer=layer, base=base,
                         norm_topk_prob=bool(norm_topk_prob), **group_opts, **options)
        self.layer, self.base, self.norm_topk_prob = layer, base, bool(norm_topk_prob)
        self.n_group, self.topk_group, self.routed_scaling_factor = n_group, topk_group, scale
        # Plain ints, not buffers: they come from the options (a loaded checkpoint leaves non-persistent
        # buffers uninitialised, and a persistent one would be carried over from the router this one replaces).
        self.disabled, self.forced = off, on
        if sigmoid:
            self.e_score_correction_bias = nn.Buffer(torch.zeros(num_experts, dtype=torch.float32))

    @classmethod
    def check_layers(cls, layers: list[int], options: dict) -> None:
        """``disable``/``force`` may name only MoE layers of the model (zoo.apply calls this first)."""
        for label in ("disable", "force"):
            unknown = sorted(int(k) for k in per_layer(options.get(label), label) if int(k) not in layers)
            if unknown:
                raise ValueError(f"{label} names layers {unknown}, but this model's MoE layers are {layers}")

    @staticmethod
    def _validate(num_experts, top_k, layer, disable, force):
        if layer is None and (disable or force):
            raise ValueError("steer needs its layer index to pick its experts: use zoo.apply (which passes it) "
                             "or pass layer=")
        key = str(layer)
        off, on = disable.get(key, []), force.get(key, [])
        for label, ids in (("disable", off), ("force", on)):
            if any(not 0 <= e < num_experts for e in ids):
                raise ValueError(f"{label}[{layer}]: expert ids must be in [0, {num_experts}), got {ids}")
        if set(off) & set(on):
            raise ValueError(f"layer {layer}: experts {sorted(set(off) & set(on))} are both disabled and forced")
        if len(on) > top_k:
            raise ValueError(f"layer {layer}: {len(on)} forced experts do not fit in top_k={top_k} slots")
        if num_experts - len(off) < top_k:
            raise ValueError(f"layer {layer}: disabling {len(off)} of {num_experts} experts leaves fewer than "
                             f"top_k={top_k}")
        return tuple(off), tuple(on)

    def forward(self, hidden: torch.Tensor) -> Routing:
        if self.base == "sigmoid-bias":
            logits = F.linear(hidden.float(), self.weight.float(), None if self.bias is None else self.bias.float())
            scores = logits.sigmoid()
            # the bias only decides which experts; disabled ones also drop out of their group's score
            choice = self._group_limit(_fill(scores + self.e_score_correction_bias, self.disabled, -torch.inf))
        else:
            logits = self.gate_logits(hidden)
            scores = choice = F.softmax(logits, dim=-1, dtype=torch.float32)
        choice = _fill(_fill(choice, self.disabled, -torch.inf), self.forced, torch.inf)
        indices = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if self.base == "sigmoid-bias" else 0))
        if self.routed_scaling_factor is not None:
            weights = weights * self.routed_scaling_factor
        return Routing(weights=weights.to(hidden.dtype), indices=indices, logits=logits)

    def _group_limit(self, choice):
        """DeepSeek-V3: only experts of the ``topk_group`` best groups (by their top-2 sum) compete. Experts of
        other groups get the lowest finite score, so they fill in only where disabling left too few."""
        if self.n_group == 1:
            return choice
        grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, 1)
        keep = keep.bool().unsqueeze(-1).expand_as(grouped).reshape(-1, self.num_experts)
        return choice.masked_fill(~keep, torch.finfo(choice.dtype).min)
