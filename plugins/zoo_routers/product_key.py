"""product-key: routing among E = n * n experts by two sets of n sub-keys (product-key memory, PEER).

The gate (``weight [2n, H]``) gives each token 2n logits: one score per sub-key of two halves. Expert ``i * n + j``
scores the sum of sub-key i of the first half and sub-key j of the second, so E scores cost 2n dot products instead
of E. The k best of the E sums are picked and weighed by a softmax over those k (renormalised again when
``norm_topk_prob``, as Doge does; a no-op up to rounding).

``split`` says where the two halves come from. ``"halves"``: each token's own logits, first n then last n (the rule of
the papers: a token's routing depends on that token alone). ``"tokens"``: Doge's rule as transformers runs it: the
[T, 2n] logits of the call's T tokens (batch rows flattened) are read as [2, T, n] in memory order, so token t's
first half is half (t % 2) of token t // 2's logits and its second half half ((T + t) % 2) of token (T + t) // 2's.
A full forward thus routes each token on other tokens' logits (a token alone, as in decoding one sequence, reads its
own two halves); converted Doge checkpoints keep it, so they compute what they computed in training.

Pruning keeps the gate whole (every sub-key serves many experts): ``expert_ids`` names the product id ``i * n + j``
of each remaining expert, in expert order, and only those ids are scored. A token whose k best experts all remain
is routed exactly as before; one that lost some picks the next best among those that remain. The E scores are
computed in full (Doge's rule: all n * n sums, not the papers' top-k-per-half shortlist, which is the same set
whenever the shortlist keeps n candidates per half).

The logits a routing gives (balance losses, statistics) are the E experts' summed scores. Papers: Lample et al.,
Large Memory Layers with Product Keys, 2019, arXiv:1907.05242; He, Mixture of A Million Experts, 2024,
arXiv:2407.04153; Doge: Shi et al., Wonderful Matrices, 2024, arXiv:2412.11834 (``zoo.architectures.doge``). No
``paper`` field, as for the other family routers: a cited paper's claim is measured on zoo-tiny-moe, whose 8 experts
are no square."""
import math

import torch
import torch.nn.functional as F
from torch import nn

from zoo.components.controls import Control
from zoo.moe import Router, Routing

SPLITS = ("halves", "tokens")


class ProductKey(Router):
    name = "product-key"
    summary = ("Product-key routing: two sets of sqrt(E) sub-key scores, each expert scored by the sum of one of "
               "each, top-k of the sums, softmax over the k (Doge's cross-token split as an option).")
    card = "cards/product-key.md"
    space = "router-explorer"

    @classmethod
    def demo_controls(cls, model=None):
        return [*super().demo_controls(model)[:1],
                Control("split", "choice", "halves", choices=SPLITS,
                        help="halves: each token's own two halves; tokens: Doge's cross-token [2, T, n] view")]

    @classmethod
    def demo_unfit(cls, model):
        from zoo.moe.layout import moe_layers

        counts = sorted({moe.num_experts for _, moe in moe_layers(model)})
        odd = [c for c in counts if math.isqrt(c) ** 2 != c]
        return (f"product-key scores n * n experts by two sets of n sub-keys; this {model.config.model_type} model's "
                f"MoE layers hold {odd[0]} experts, no square") if odd else ""

    def __init__(self, hidden_size, num_experts, top_k, num_keys: int | None = None, split: str = "halves",
                 norm_topk_prob: bool = False, expert_ids: list | None = None, **options):
        if num_keys is None:
            num_keys = math.isqrt(int(num_experts))
        if isinstance(num_keys, bool) or not isinstance(num_keys, int) or num_keys < 1:
            raise ValueError(f"num_keys must be a positive integer, got {num_keys!r}")
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if expert_ids is not None and not isinstance(expert_ids, (list, tuple)):
            raise ValueError(f"expert_ids must be a list of product ids or None, got {expert_ids!r}")
        ids = None if expert_ids is None else list(expert_ids)
        if ids is None and num_keys * num_keys != num_experts:
            raise ValueError(f"product-key scores num_keys**2 experts: {num_experts} experts need num_keys = sqrt of "
                             f"it (got {num_keys}), or expert_ids naming each expert's product id")
        if ids is not None and not (all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_keys ** 2
                                        for i in ids) and len(ids) == num_experts == len(set(ids))):
            raise ValueError(f"expert_ids must name {num_experts} distinct product ids in [0, {num_keys ** 2}), "
                             f"got {expert_ids!r}")
        if ids == list(range(num_keys ** 2)):
            ids = None  # every pair, in order: the plain form
        extra = {} if ids is None else {"expert_ids": ids}
        super().__init__(hidden_size, num_experts, top_k, num_keys=num_keys, split=split,
                         norm_topk_prob=bool(norm_topk_prob), **extra, **options)
        self.num_keys, self.split, self.norm_topk_prob, self.expert_ids = num_keys, split, bool(norm_topk_prob), ids
        self.weight = nn.Parameter(torch.empty(2 * num_keys, hidden_size))  # the two halves' sub-keys
        self.bias = nn.Parameter(torch.zeros(2 * num_keys)) if self.bias is not None else None
        nn.init.normal_(self.weight, std=0.02)
        self._ids = {}  # device -> expert_ids as a tensor

    def halves(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The two sets of sub-key scores ``[T, n]`` each token is scored by, from the gate's ``[T, 2n]`` logits."""
        T, n = logits.shape[0], self.num_keys
        if self.split == "tokens":  # Doge: the flat logits read as [2, T, n]
            first, second = logits.reshape(2, T, n)
        else:
            first, second = logits.view(T, 2, n).unbind(1)
        return first, second

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, E]``: each expert's score, the sum of its two sub-keys' (in expert order)."""
        first, second = self.halves(self.gate_logits(hidden))
        scores = (first[:, :, None] + second[:, None, :]).flatten(1)  # product id i * n + j
        if self.expert_ids is None:
            return scores
        ids = self._ids.get(scores.device)
        if ids is None:
            ids = self._ids[scores.device] = torch.tensor(self.expert_ids, device=scores.device)
        return scores.index_select(1, ids)

    def forward(self, hidden: torch.Tensor) -> Routing:
        scores = self.scores(hidden)
        top, indices = scores.topk(self.top_k, dim=-1)
        weights = F.softmax(top, dim=-1)  # in the scores' dtype, as Doge
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(weights=weights.to(hidden.dtype), indices=indices, logits=scores)

    def reference(self, hidden: torch.Tensor, context=None) -> Routing:
        """Token by token, written out from the flat logits."""
        T, n = hidden.shape[0], self.num_keys
        flat = self.gate_logits(hidden).reshape(-1)
        ids = self.expert_ids if self.expert_ids is not None else list(range(n * n))
        rows = []
        for t in range(T):
            if self.split == "tokens":
                first, second = flat[t * n:(t + 1) * n], flat[(T + t) * n:(T + t + 1) * n]
            else:
                first, second = flat[2 * t * n:(2 * t + 1) * n], flat[(2 * t + 1) * n:(2 * t + 2) * n]
            scores = torch.stack([first[p // n] + second[p % n] for p in ids])
            order = sorted(range(len(ids)), key=lambda e: -scores[e].item())[:self.top_k]
            w = torch.exp(scores[order] - scores[order].max())
            w = w / w.sum()
            if self.norm_topk_prob:
                w = w / w.sum()
            rows.append((w, torch.tensor(order), scores))
        w, i, lg = (torch.stack(c) for c in zip(*rows))
        return Routing(weights=w.to(hidden.dtype), indices=i, logits=lg)

    def keep_rows(self, rows) -> "ProductKey":
        """This router for only its experts ``rows`` (in that order): the gate stays whole, the kept experts' product
        ids are recorded (``zoo.moe.surgery`` calls this: the gate has no row per expert to slice)."""
        ids = self.expert_ids if self.expert_ids is not None else list(range(self.num_keys ** 2))
        kept = [ids[int(r)] for r in rows]
        options = {k: v for k, v in self.options.items() if k != "expert_ids"}
        router = ProductKey(self.hidden_size, len(kept), min(self.top_k, len(kept)), **options, expert_ids=kept)
        router.load_state_dict(self.state_dict())
        return router
