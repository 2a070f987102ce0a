"""RoMA's pieces, apart from the adapter: each sample's routing profile, its successful neighbours in a
task-embedding space, and the manifold penalty ``(1/B) sum_i sum_{j in N(i)} W_ij ||r_i - r_j||^2``.

A sample's routing profile ``r_i`` is, for each tuned MoE layer, the router's softmax over all its experts
averaged over the sample's (unpadded) tokens, the layers concatenated: ``[L * E]``. The successful neighbours
``N(i)`` are the ``k`` nearest samples of a bank of successful samples (cosine similarity of the L2-normalised
embeddings; the sample itself, if it is in the bank, excluded), weighted by the heat kernel
``W_ij = exp(-||e_i - e_j||^2 / bandwidth)``. The neighbours' profiles are the bank's fixed record of the routing
that led to their success (recorded once, before training): the gradient reaches ``r_i`` only.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class Bank:
    """The pool the neighbours come from: per sample its embedding (L2-normalised), routing profile, next-token
    accuracy, whether it counts as successful, a key of its token ids (to exclude a sample from its own
    neighbours) and its domain. ``layers``: the MoE layers the profiles cover."""
    embeddings: torch.Tensor  # [P, D]
    routing: torch.Tensor  # [P, L * E]
    accuracy: torch.Tensor  # [P]
    successful: torch.Tensor  # [P] bool
    keys: list = field(default_factory=list)
    domains: list = field(default_factory=list)
    layers: tuple = ()
    threshold: float = 0.0

    def successes(self):
        """(embeddings, routing profiles, keys) of the successful samples only: the neighbours' candidates."""
        keep = self.successful.nonzero().flatten().tolist()
        return self.embeddings[keep], self.routing[keep], [self.keys[i] for i in keep]

    def summary(self) -> dict:
        return {"pool": len(self.keys), "successful": int(self.successful.sum()), "threshold": round(self.threshold, 4),
                "layers": list(self.layers),
                "successful by domain": {d: sum(1 for i, x in enumerate(self.domains) if x == d and self.successful[i])
                                         for d in dict.fromkeys(self.domains)}}


def ids_key(ids: torch.Tensor) -> int:
    """A key of one sample's token ids (its unpadded tokens), equal for equal samples."""
    return hash(tuple(ids.tolist()))


@contextlib.contextmanager
def capture_routing(moe_blocks: dict):
    """While inside, every call of the routers of ``moe_blocks`` ({layer: SparseMoE}) appends its softmax over all
    experts ``[T, E]`` (float32, with its gradient) to ``probs[layer]``; yields ``probs``. A router whose
    ``Routing`` carries no logits is read through its gate (``gate_logits``)."""
    probs = {i: [] for i in moe_blocks}

    def hook(i):
        def record(router, args, out):
            logits = out.logits if out.logits is not None else router.gate_logits(args[0])
            probs[i].append(logits.float().softmax(-1))
        return record

    handles = [moe.router.register_forward_hook(hook(i)) for i, moe in moe_blocks.items()]
    try:
        yield probs
    finally:
        for h in handles:
            h.remove()


def routing_profile(probs: dict, batch: int, seq: int, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, L * E]``: per layer (in ``probs``' order) the softmax averaged over each sample's unpadded tokens."""
    mask = torch.ones(batch, seq) if attention_mask is None else attention_mask.float()
    parts = []
    for i, calls in probs.items():
        if len(calls) != 1:
            raise RuntimeError(f"roma: layer {i}'s router ran {len(calls)} times in one forward (expected once)")
        p = calls[0].view(batch, seq, -1)
        m = mask.to(p.device)[..., None]
        parts.append((p * m).sum(1) / m.sum(1).clamp(min=1))
    return torch.cat(parts, -1)


def neighbours(queries: torch.Tensor, candidates: torch.Tensor, k: int, bandwidth: float, exclude=None):
    """The ``k`` nearest candidates of each query by cosine similarity (both L2-normalised), and their heat-kernel
    weights ``exp(-||q - c||^2 / bandwidth)``. ``exclude [B, N]`` (bool) marks candidates a query may not take
    (itself); a query with fewer than ``k`` allowed candidates gets weight 0 on the rest. -> (idx [B, k], W [B, k])."""
    sim = queries.float() @ candidates.float().T
    if exclude is not None:
        sim = sim.masked_fill(exclude, float("-inf"))
    top, idx = sim.topk(min(k, candidates.shape[0]), dim=1)
    dist2 = (2 - 2 * top).clamp(min=0)  # ||q - c||^2 of unit vectors; inf where excluded -> weight 0
    return idx, torch.exp(-dist2 / bandwidth)


def manifold_penalty(profiles: torch.Tensor, targets: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor):
    """``(1/B) sum_i sum_j W_ij ||r_i - r_j||^2`` with ``r_j = targets[idx[i, j]]`` (fixed, no gradient)."""
    diff = profiles[:, None, :] - targets.detach().to(profiles)[idx]
    return (weights.to(profiles) * diff.pow(2).sum(-1)).sum(1).mean()


def manifold_penalty_reference(profiles, targets, idx, weights):
    """The same, one sample and one neighbour at a time (what the tests compare the fast path with)."""
    total = profiles.new_zeros(())
    for i in range(profiles.shape[0]):
        for j in range(idx.shape[1]):
            r_j = targets[int(idx[i, j])].detach().to(profiles)
            total = total + weights[i, j].to(profiles) * ((profiles[i] - r_j) ** 2).sum()
    return total / profiles.shape[0]


def next_token_accuracy(logits: torch.Tensor, ids: torch.Tensor, attention_mask=None) -> torch.Tensor:
    """[B]: the share of each sample's next tokens the model predicts right (argmax), over unpadded positions."""
    right = (logits[:, :-1].argmax(-1) == ids[:, 1:]).float()
    mask = torch.ones_like(right) if attention_mask is None else (attention_mask[:, 1:] * attention_mask[:, :-1]).float()
    return (right * mask).sum(1) / mask.sum(1).clamp(min=1)


def normalised(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x.float(), dim=-1)
