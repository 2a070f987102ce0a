"""sigmoid-bias: DeepSeek-V3 routing. Sigmoid affinities; a per-expert bias steers *selection only*;
group-limited top-k; kept affinities renormalised and scaled by ``routed_scaling_factor``.

Auxiliary-loss-free balancing, DeepSeek-V3's training rule: with ``bias_update_speed`` gamma > 0, the router counts
in training how many tokens each expert was picked for, and ``after_step()`` (called after every optimizer step by
``moe-zoo finetune``, or by your own loop) moves each expert's bias by gamma toward balance:
``b_e += gamma * sign(mean load - load_e)``. gamma 0 (the default) leaves the bias as loaded, as at inference."""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from zoo.moe import Router, Routing
from zoo.components.controls import Control, layer_top_k


class SigmoidBias(Router):
    name = "sigmoid-bias"
    summary = "DeepSeek-V3 sigmoid routing with selection-only bias correction and group-limited top-k."
    paper = "DeepSeek-AI, DeepSeek-V3 Technical Report, 2024. arXiv:2412.19437"
    card = "cards/sigmoid-bias.md"
    space = "router-explorer"

    @classmethod
    def demo_controls(cls, model=None):
        return [*super().demo_controls(model)[:1],
                Control("norm_topk_prob", "bool", True, help="renormalise the kept scores"),
                Control("routed_scaling_factor", "float", 1.0, low=0.1, high=4.0, step=0.1,
                        help="scale of the routed output")]

    @classmethod
    def demo_presets(cls, model=None):
        k = layer_top_k(model) or 2
        return {"mild": {"top_k": k}, "strong": {"top_k": k, "norm_topk_prob": False}}

    def __init__(self, hidden_size, num_experts, top_k, n_group: int | None = 1, topk_group: int | None = 1,
                 norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0, bias_update_speed: float = 0.0,
                 **options):
        for label, value in (("n_group", n_group), ("topk_group", topk_group)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{label} must be a positive integer (0 or None: not set), got {value!r}")
        if isinstance(routed_scaling_factor, bool) or not routed_scaling_factor > 0:
            raise ValueError(f"routed_scaling_factor must be positive, got {routed_scaling_factor!r}")
        if isinstance(bias_update_speed, bool) or not isinstance(bias_update_speed, (int, float)) \
                or not 0 <= bias_update_speed < float("inf"):
            raise ValueError(f"bias_update_speed must be a number >= 0 (DeepSeek-V3 trains with 0.001), "
                             f"got {bias_update_speed!r}")
        n_group, topk_group = n_group or 1, topk_group or 1
        if num_experts % n_group:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by n_group ({n_group})")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
        if top_k > topk_group * (num_experts // n_group):
            raise ValueError(f"top_k={top_k} exceeds the experts in {topk_group} of {n_group} groups")
        super().__init__(hidden_size, num_experts, top_k, n_group=n_group, topk_group=topk_group,
                         norm_topk_prob=bool(norm_topk_prob), routed_scaling_factor=float(routed_scaling_factor),
                         **({"bias_update_speed": float(bias_update_speed)} if bias_update_speed else {}), **options)
        self.bias_update_speed = float(bias_update_speed)
        # tokens each expert was picked for since the last after_step: training state, not a buffer (never saved,
        # never on the meta device of a loading model), made on first use on the device routing runs on
        self.picks = None
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = bool(norm_topk_prob), float(routed_scaling_factor)
        # Updated outside backprop (aux-loss-free balancing), so a buffer, kept in fp32; the gate is fp32 too, as
        # DeepSeek-V3 keeps it (created so even under a bf16/fp16 default dtype).
        self.e_score_correction_bias = nn.Buffer(torch.zeros(num_experts, dtype=torch.float32))
        self.weight = nn.Parameter(self.weight.detach().to(torch.float32))

    def init_weights(self, std: float) -> None:
        super().init_weights(std)
        init.zeros_(self.e_score_correction_bias)  # as DeepSeek-V3's own router

    def forward(self, hidden: torch.Tensor) -> Routing:
        bias = None if self.bias is None else self.bias.float()
        logits = F.linear(hidden.float(), self.weight.float(), bias)
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias  # the bias only decides *which* experts
        if self.n_group > 1:
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, 1)
            keep = keep.bool().unsqueeze(-1).expand_as(grouped).reshape(-1, self.num_experts)
            choice = choice.masked_fill(~keep, float("-inf"))
        indices = choice.topk(self.top_k, dim=-1).indices
        if self.training and self.bias_update_speed:
            with torch.no_grad():
                counts = torch.bincount(indices.reshape(-1), minlength=self.num_experts).float()
                self.picks = counts if self.picks is None else self.picks + counts
        weights = scores.gather(1, indices)  # ...while the weights come from the unbiased affinities
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * self.routed_scaling_factor
        return Routing(weights=weights.to(hidden.dtype), indices=indices, logits=logits)

    @torch.no_grad()
    def after_step(self) -> None:
        """DeepSeek-V3's bias update after an optimizer step: an overloaded expert's bias goes down by
        ``bias_update_speed``, an underloaded one's up (loads counted since the last call); then the counts reset."""
        picks, self.picks = self.picks, None
        if self.bias_update_speed and picks is not None and picks.sum() > 0:
            picks = picks.to(self.e_score_correction_bias.device)
            self.e_score_correction_bias += self.bias_update_speed * torch.sign(picks.mean() - picks)
