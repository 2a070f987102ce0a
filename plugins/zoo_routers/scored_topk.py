"""scored-topk: the top-k routing rules of transformers' MoE families in one parameterised router.

Scores are a softmax, a sigmoid or (DeepSeek-V4) the square root of a softplus of the (optionally scaled, as Muse
Spark's ``output_multiplier`` does, and soft-capped) gate logits; a selection-only bias (``e_score_correction_bias``) may steer which experts are picked; selection
may be limited to the best ``topk_group`` of ``n_group`` expert groups (group score: sum of the group's two best,
or its best; experts outside the kept groups are ruled out, or, as A.X-K2 does, only given a choice score of 0); the
kept scores are optionally renormalised and scaled. Conversion finds the options that reproduce a
family's own router exactly (``zoo.architectures.generic``)."""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from zoo.moe import Router, Routing
from zoo.components.controls import Control, layer_top_k


def softmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.softmax(-1)


def sigmoid(logits: torch.Tensor) -> torch.Tensor:
    return logits.sigmoid()


def sqrtsoftplus(logits: torch.Tensor) -> torch.Tensor:
    """sqrt(softplus(x)): DeepSeek-V4's router score (transformers' ``ACT2FN["sqrtsoftplus"]``)."""
    return F.softplus(logits).sqrt()


# score name -> the function from [T, E] gate logits to [T, E] expert scores (also read by token-hash)
SCORE_FUNCTIONS = {"softmax": softmax, "sigmoid": sigmoid, "sqrtsoftplus": sqrtsoftplus}
SCORES = tuple(SCORE_FUNCTIONS)
GROUP_SCORES = ("top2", "max")
GROUP_FILLS = {"-inf": float("-inf"), "zero": 0.0}  # the choice score of experts outside the kept groups


class ScoredTopK(Router):
    name = "scored-topk"
    summary = ("Top-k routing of transformers' MoE families: softmax, sigmoid or sqrt-softplus scores, selection-only "
               "bias, group-limited selection, renormalisation, scaling, logit soft-cap.")
    paper = ("Shazeer et al., Outrageously Large Neural Networks, 2017, arXiv:1701.06538; DeepSeek-AI, "
             "DeepSeek-V2, 2024, arXiv:2405.04434 (group-limited selection); Wang et al., Auxiliary-Loss-Free "
             "Load Balancing, 2024, arXiv:2408.15664 (selection bias)")
    card = "cards/scored-topk.md"
    space = "router-explorer"

    @classmethod
    def demo_controls(cls, model=None):
        return [*super().demo_controls(model)[:1],
                Control("score", "choice", "softmax", choices=SCORES, help="gate score function"),
                Control("norm_topk_prob", "bool", True, help="renormalise the kept scores"),
                Control("routed_scaling_factor", "float", 1.0, low=0.1, high=4.0, step=0.1,
                        help="scale of the routed output"),
                Control("logit_softcap", "float", 0.0, low=0.0, high=50.0, step=1.0, help="tanh cap of the logits (0: off)")]

    @classmethod
    def demo_presets(cls, model=None):
        k = layer_top_k(model) or 2
        return {"mild": {"top_k": k, "score": "sigmoid"}, "strong": {"top_k": k, "score": "sqrtsoftplus",
                                                                     "norm_topk_prob": False}}

    def __init__(self, hidden_size, num_experts, top_k, score: str = "softmax", norm_topk_prob: bool = True,
                 routed_scaling_factor: float = 1.0, selection_bias: bool = False, n_group: int = 1,
                 topk_group: int = 1, group_score: str = "top2", logit_softcap: float = 0.0,
                 bias_on: str = "scores", group_fill: str = "-inf", logit_scale: float = 1.0, **options):
        if score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {score!r}")
        if bias_on not in ("scores", "logits"):
            raise ValueError(f"bias_on must be 'scores' or 'logits', got {bias_on!r}")
        if group_score not in GROUP_SCORES:
            raise ValueError(f"group_score must be one of {GROUP_SCORES}, got {group_score!r}")
        if group_fill not in GROUP_FILLS:
            raise ValueError(f"group_fill must be one of {tuple(GROUP_FILLS)}, got {group_fill!r}")
        for label, value in (("n_group", n_group), ("topk_group", topk_group)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{label} must be a positive integer, got {value!r}")
        if num_experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"need num_experts ({num_experts}) divisible by n_group ({n_group}) and "
                             f"1 <= topk_group ({topk_group}) <= n_group")
        if top_k > topk_group * (num_experts // n_group) and group_fill == "-inf":  # ruled-out experts cannot fill k
            raise ValueError(f"top_k={top_k} exceeds the experts in {topk_group} of {n_group} groups")
        if isinstance(routed_scaling_factor, bool) or not routed_scaling_factor > 0:
            raise ValueError(f"routed_scaling_factor must be positive, got {routed_scaling_factor!r}")
        if isinstance(logit_softcap, bool) or not logit_softcap >= 0:
            raise ValueError(f"logit_softcap must be >= 0 (0: off), got {logit_softcap!r}")
        if isinstance(logit_scale, bool) or not isinstance(logit_scale, (int, float)) or not 0 < logit_scale < float("inf"):
            raise ValueError(f"logit_scale must be a positive finite number, got {logit_scale!r}")
        super().__init__(hidden_size, num_experts, top_k, score=score, norm_topk_prob=bool(norm_topk_prob),
                         routed_scaling_factor=float(routed_scaling_factor), selection_bias=bool(selection_bias),
                         n_group=n_group, topk_group=topk_group, group_score=group_score,
                         logit_softcap=float(logit_softcap), bias_on=bias_on,
                         **({"group_fill": group_fill} if group_fill != "-inf" else {}),
                         **({"logit_scale": float(logit_scale)} if logit_scale != 1 else {}),
                         **options)  # options at their defaults stay out: layouts written before them unchanged
        self.score, self.norm_topk_prob = score, bool(norm_topk_prob)
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.n_group, self.topk_group, self.group_score = n_group, topk_group, group_score
        self.logit_softcap, self.bias_on, self.group_fill = float(logit_softcap), bias_on, group_fill
        self.logit_scale = float(logit_scale)  # Muse Spark multiplies its fp32 logits before the sigmoid
        # a selection bias is updated outside backprop (aux-loss-free balancing): an fp32 buffer
        bias_buffer = nn.Buffer(torch.zeros(num_experts, dtype=torch.float32)) if selection_bias else None
        self.e_score_correction_bias = bias_buffer

    def init_weights(self, std: float) -> None:
        super().init_weights(std)
        if self.e_score_correction_bias is not None:
            init.zeros_(self.e_score_correction_bias)

    def forward(self, hidden: torch.Tensor) -> Routing:
        bias = None if self.bias is None else self.bias.float()
        logits = F.linear(hidden.float(), self.weight.float(), bias)
        if self.logit_scale != 1:
            logits = logits * self.logit_scale
        if self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        scores = SCORE_FUNCTIONS[self.score](logits)
        choice = scores if self.bias_on == "scores" else logits
        if self.e_score_correction_bias is not None:
            choice = choice + self.e_score_correction_bias
        if self.n_group > 1:
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            if self.group_score == "top2":
                group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            else:
                group_scores = grouped.max(-1).values
            keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, 1)
            keep = keep.bool().unsqueeze(-1).expand_as(grouped).reshape(-1, self.num_experts)
            choice = choice.masked_fill(~keep, GROUP_FILLS[self.group_fill])
        indices = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, indices)  # the bias picks experts; the weights are the unbiased scores
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * self.routed_scaling_factor
        return Routing(weights=weights.to(hidden.dtype), indices=indices, logits=logits)
