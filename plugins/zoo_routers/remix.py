"""remix: ReMix's reinforcement routing. The selected experts (LoRAs) get equal, non-learnable weights 1/k; the
router is a policy trained with RLOO (REINFORCE leave-one-out), the supervised loss as the (negative) reward.

Policy: per token, k distinct experts drawn without replacement from softmax(logits) (Gumbel top-k, i.e. a
Plackett-Luce draw); ``log_prob`` of the ordered draw is recorded on the router while training. At eval the
selection is the deterministic top-k of the logits. Because the weights carry no gradient, the router learns only
through ``rloo_loss``: each sequence is run ``num_samples`` times with independent draws, the reward of a draw is
minus its loss, the baseline the mean reward of the other draws of the same sequence, and the surrogate
``-(reward - baseline) * log pi(draw)`` (log pi summed over every token and remix router, divided by the row's
token count) is added to the mean supervised loss, which trains the experts.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from zoo.moe import Router, Routing
from zoo.components.controls import Control


class Remix(Router):
    name = "remix"
    summary = "ReMix: equal 1/k weights for the selected experts; the router is a policy trained with RLOO."
    paper = ("Qiu et al., ReMix: Reinforcement routing for mixtures of LoRAs in LLM finetuning, 2026, "
             "arXiv:2603.10160; Kool et al., Buy 4 REINFORCE Samples, Get a Baseline for Free!, 2019 (RLOO)")
    card = "cards/remix.md"
    space = "router-explorer"

    @classmethod
    def demo_controls(cls, model=None):
        return [*super().demo_controls(model)[:1],
                Control("num_samples", "int", 4, low=2, high=16, step=1, help="policy samples per token (training)")]

    def __init__(self, hidden_size, num_experts, top_k, num_samples: int = 4, **options):
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 2:
            raise ValueError(f"num_samples must be an integer >= 2 (RLOO needs a leave-one-out baseline), "
                             f"got {num_samples!r}")
        super().__init__(hidden_size, num_experts, top_k, num_samples=num_samples, **options)
        self.num_samples = num_samples
        self.log_prob: torch.Tensor | None = None  # [T] log pi of the last sampled selection (training only)

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """[T, k] distinct experts drawn without replacement from softmax(logits) (Gumbel top-k)."""
        u = torch.rand_like(logits, dtype=torch.float32).clamp_(min=1e-20, max=1 - 1e-7)
        return (logits.float() - torch.log(-torch.log(u))).topk(self.top_k, dim=-1).indices

    def forward(self, hidden: torch.Tensor) -> Routing:
        logits = self.gate_logits(hidden)
        if self.training:
            indices = self.sample(logits.detach())
            self.log_prob = plackett_luce_log_prob(logits, indices)
        else:
            indices = logits.topk(self.top_k, dim=-1).indices
            self.log_prob = None
        weights = torch.full(indices.shape, 1.0 / self.top_k, dtype=hidden.dtype, device=hidden.device)
        return Routing(weights=weights, indices=indices, logits=logits)


def plackett_luce_log_prob(logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """[T] log-probability of drawing ``indices`` [T, k] in this order without replacement from softmax(logits):
    sum_j log p_{i_j} - log(1 - sum_{l<j} p_{i_l})."""
    logp = F.log_softmax(logits.float(), dim=-1).gather(-1, indices)  # [T, k]
    taken = logp.exp().cumsum(-1) - logp.exp()  # mass of the experts drawn before slot j
    return (logp - torch.log1p(-taken.clamp(max=1 - 1e-6))).sum(-1)


class RlooLoss(NamedTuple):
    loss: torch.Tensor  # lm_loss + surrogate: what to backpropagate
    lm_loss: torch.Tensor  # mean supervised loss over the samples (trains the experts / LoRAs)
    surrogate: torch.Tensor  # the RLOO policy-gradient term (trains the routers)
    rewards: torch.Tensor  # [S, B] minus each draw's per-sequence loss


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """[S, B] reward minus the mean reward of the other S-1 samples of the same sequence."""
    S = rewards.shape[0]
    return rewards - (rewards.sum(0, keepdim=True) - rewards) / (S - 1)


def remix_routers(model) -> list[Remix]:
    return [m for m in model.modules() if isinstance(m, Remix)]


def rloo_loss(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
              num_samples: int | None = None) -> RlooLoss:
    """ReMix's training loss for a model in training mode whose routers (some or all) are ``remix``.

    The batch [B, L] is repeated ``num_samples`` times (default: the routers' own ``num_samples``) and run in one
    forward, so every row draws its own selections. Rows are scored by their mean next-token loss.
    """
    routers = remix_routers(model)
    if not routers:
        raise ValueError("the model has no remix router")
    S = int(num_samples or routers[0].num_samples)
    if S < 2:
        raise ValueError(f"num_samples must be >= 2, got {S}")
    B, L = input_ids.shape
    ids = input_ids.repeat(S, 1)  # sample s is rows s*B .. (s+1)*B - 1
    mask = None if attention_mask is None else attention_mask.repeat(S, 1)
    for r in routers:
        r.log_prob = None
    logits = model(input_ids=ids, attention_mask=mask).logits
    valid = torch.ones_like(ids, dtype=torch.float32) if mask is None else mask.float()
    ce = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")  # [S*B, L-1]
    row_loss = (ce * valid[:, 1:]).sum(1) / valid[:, 1:].sum(1).clamp(min=1)
    log_pi = torch.zeros(S * B, device=ids.device)
    for r in routers:
        if r.log_prob is None:
            raise RuntimeError("a remix router did not sample: call rloo_loss with the model in training mode")
        log_pi = log_pi + (r.log_prob.view(S * B, L) * valid).sum(1)
        r.log_prob = None
    log_pi = log_pi / valid.sum(1).clamp(min=1)
    rewards = -row_loss.detach().view(S, B)
    surrogate = -(rloo_advantages(rewards) * log_pi.view(S, B)).mean()
    lm_loss = row_loss.mean()
    return RlooLoss(lm_loss + surrogate, lm_loss, surrogate, rewards)
