"""hodge-cover: HodgeCover, learning-free expert reduction by higher-order topological coverage.

Per MoE layer, on the calibration tokens that reach it:

1. Merge barriers. ``b_ij``: the squared error of the layer's routed output when experts i and j are both served by
   their frequency-weighted merge, relative to the routed output's squared norm (0: merging them changes nothing).
   ``b_ijk``: the same for three experts merged into one.
2. The mergeability complex at level ``tau`` (the ``edge_quantile`` quantile of the pairwise barriers): vertices are
   the experts, edges the pairs with ``b_ij <= tau``, filled triangles the triples of such edges with
   ``b_ijk <= tau``. A triple that is pairwise mergeable but not jointly leaves a hollow triangle: a cycle.
3. The Hodge decomposition of the edge signal ``f = (b_ij)`` on that complex (``zoo_compressors.hodge``): gradient,
   curl and harmonic parts. Harmonic-critical edges weigh ``|h_e|`` (the part of the barrier that lives on cycles
   no jointly mergeable triple fills); triplet-critical triangles (all triples of edges, filled or not) weigh
   their triplet excess ``max(0, b_ijk - max(b_ij, b_ik, b_jk))``, what no pair predicts. Each family is
   normalised to total weight 1.
4. Greedy cover: keep ``num_experts`` experts, each in turn the one touching the most uncovered critical weight
   (ties and leftover picks: the most routed).
5. Reduction: every other expert is merged (frequency-weighted) into the kept expert it has the lowest pairwise
   barrier with; the router keeps all its rows, each served by its group's expert (an expert map, as hc-smoe).
   ``reduce="prune"`` drops them instead.
6. Hybrid (``sparsity > 0``, HodgeCover+Wanda): Wanda pruning of each surviving expert's weights.

The paper's abstract fixes the complex (experts; edges with merge barriers; faces with triplet barriers), the Hodge
decomposition of the edge-barrier signal, the greedy cover of harmonic-critical edges and triplet-critical
triangles, and the hybrid with off-the-shelf pruning. Its method section was not reachable here: the barrier
(the paper's is a KL barrier; here the layer's output error, which the per-layer contract can measure), the
threshold, the critical weights, the cover's gain and the merge assignment are the zoo's reconstruction.
"""
from __future__ import annotations

import torch

from zoo.components.controls import Control
from zoo.moe.surgery import keep_experts, merge_experts
from zoo.components.options import check_float

from zoo_compressors.base import ExpertCountCompressor
from zoo_compressors.hodge import boundary_matrices, cliques, edges_below, greedy_cover, hodge_decomposition
from zoo_compressors.wanda import wanda_prune_experts

REDUCTIONS = ("merge", "prune")


class MergeBarriers:
    """The merge barriers of one block's experts on its calibration tokens ``x [T, H]`` (float32 arithmetic, float64
    sums). Only the (token, slot) pairs routed to a merged expert change, so each barrier runs the merged expert on
    those tokens alone."""

    @torch.no_grad()
    def __init__(self, moe, x: torch.Tensor):
        old = moe.experts
        self.kind, self.options = type(old), {**old.options(), "num_experts": 1}
        self.params = {k: v.detach().float() for k, v in old.state_dict().items()}
        self.scale_input = moe.weights_scale_input
        routing = moe.route(x)
        xf = moe.expert_inputs(x).float()
        self.tokens, self.inputs, self.gates, self.outputs = [], [], [], []
        routed = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64, device=x.device)
        for e in range(moe.num_experts):
            tok, slot = (routing.indices == e).nonzero(as_tuple=True)
            g = routing.weights[tok, slot].float()
            rows = xf[tok] * g[:, None] if self.scale_input else xf[tok]
            out = self._expert({k: v[e] for k, v in self.params.items()}, rows)
            self.tokens.append(tok)
            self.inputs.append(rows)
            self.gates.append(g)
            self.outputs.append(out)
            routed.index_add_(0, tok, self._weighted(out, g))
        self.num_tokens = x.shape[0]
        self.norm = float((routed ** 2).sum()) or 1.0
        self.counts = torch.tensor([len(t) for t in self.tokens], dtype=torch.float64, device=x.device)
        self.frequency = self.counts + 1e-9  # an expert never routed to still counts a little

    def _expert(self, params: dict, rows: torch.Tensor) -> torch.Tensor:
        with torch.device("meta"):
            module = self.kind(**self.options)
        module.load_state_dict({k: v[None] for k, v in params.items()}, assign=True)
        return module.expert(0, rows)

    def _weighted(self, out: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return out.double() if self.scale_input else (out * g[:, None]).double()

    @torch.no_grad()
    def __call__(self, members) -> float:
        """The relative output error of serving every expert of ``members`` by their frequency-weighted merge."""
        members = list(members)
        if sum(len(self.tokens[e]) for e in members) == 0:
            return 0.0
        w = (self.frequency[members] / self.frequency[members].sum()).float()
        merged = {k: torch.einsum("e,e...->...", w, v[members]) for k, v in self.params.items()}
        joined = self._expert(merged, torch.cat([self.inputs[e] for e in members]))
        # a token routed to two members changes in both slots: sum its changes before squaring
        change = torch.zeros(self.num_tokens, joined.shape[-1], dtype=torch.float64, device=joined.device)
        start = 0
        for e in members:
            stop = start + len(self.inputs[e])
            change.index_add_(0, self.tokens[e], self._weighted(joined[start:stop] - self.outputs[e], self.gates[e]))
            start = stop
        return float((change ** 2).sum()) / self.norm


def hodge_cover_plan(barriers: MergeBarriers, n: int, keep: int, edge_quantile: float):
    """``(kept experts in pick order, owner of each expert, diagnostics)`` for one layer, from its barriers."""
    pair = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in range(i + 1, n):
            pair[i, j] = pair[j, i] = barriers([i, j])
    upper = pair[torch.triu_indices(n, n, 1).unbind()]
    tau = float(torch.quantile(upper, edge_quantile)) if len(upper) else 0.0
    edges = edges_below(pair, tau)
    candidates = cliques(n, edges)
    triple = {c: barriers(c) for c in candidates}
    triangles = [c for c in candidates if triple[c] <= tau]
    b1, b2 = boundary_matrices(n, edges, triangles)
    f = torch.tensor([float(pair[i, j]) for i, j in edges], dtype=torch.float64)
    gradient, curl, harmonic = hodge_decomposition(b1, b2, f)
    noise = 1e-9 * float(f.abs().max()) if len(f) else 0.0  # round-off of the projections is no harmonic part
    edge_weight = _normalised({e: abs(float(h)) for e, h in zip(edges, harmonic) if abs(float(h)) > noise})
    excess = {c: max(0.0, triple[c] - max(float(pair[c[0], c[1]]), float(pair[c[0], c[2]]), float(pair[c[1], c[2]])))
              for c in candidates}
    triangle_weight = _normalised(excess)
    kept = greedy_cover(n, keep, edge_weight, triangle_weight, barriers.counts.tolist())
    owner = {e: (e if e in kept else min(kept, key=lambda s: (float(pair[e, s]), s))) for e in range(n)}

    def retained(values: dict) -> float:  # share of a signal's mass on simplices a kept expert touches
        total = sum(values.values())
        return round(sum(v for s, v in values.items() if set(s) & set(kept)) / total, 4) if total > 0 else 1.0

    energy = float((f ** 2).sum()) or 1.0
    parts = {"gradient": gradient, "curl": curl, "harmonic": harmonic}
    diagnostics = {
        "tau": round(tau, 6), "edges": len(edges), "cliques": len(candidates), "triangles": len(triangles),
        "betti_1": _betti_1(b1, b2),
        "energy": {k: round(float((v ** 2).sum()) / energy, 4) for k, v in parts.items()},
        "retained": {**{k: retained({e: float(x) ** 2 for e, x in zip(edges, v)}) for k, v in parts.items()},
                     "triplet": retained(excess)},
    }
    return kept, owner, diagnostics


def _normalised(weights: dict) -> dict:
    total = sum(weights.values())
    return {k: v / total for k, v in weights.items()} if total > 0 else {}


def _betti_1(b1: torch.Tensor, b2: torch.Tensor) -> int:
    """dim ker L1 = edges - rank B1 - rank B2."""
    rank = (lambda a: int(torch.linalg.matrix_rank(a)) if a.numel() else 0)
    return b1.shape[1] - rank(b1) - rank(b2)


class HodgeCover(ExpertCountCompressor):
    """Options:

    - num_experts: experts kept in every MoE layer (the cover's survivors)
    - edge_quantile: level of the complex, the quantile of the pairwise barriers up to which pairs are edges
    - reduce: merge (fold each dropped expert into its lowest-barrier survivor, by frequency) or prune (drop it)
    - sparsity: the hybrid: Wanda-prune this share of each surviving expert's weights (0: HodgeCover alone)

    Cost per layer: one merged-expert pass over its routed tokens per pair of experts and per triple of edges.
    """

    name = "hodge-cover"
    summary = ("HodgeCover: Hodge-decompose the experts' pairwise merge barriers on a 2-complex with triplet "
               "barriers, greedily keep experts covering harmonic-critical edges and triplet-critical triangles, merge "
               "the rest into them; sparsity > 0 adds Wanda pruning of the survivors (the hybrid).")
    paper = ("Zhong, Zheng, Allen-Blanchette, HodgeCover: Higher-Order Topological Coverage Drives Compression of "
             "Sparse Mixture-of-Experts, 2026, arXiv:2605.13997")
    card = "cards/hodge-cover.md"
    space = "compression-lab"

    @classmethod
    def demo_controls(cls, model=None):
        return [*super().demo_controls(model),
                Control("sparsity", "float", 0.0, low=0.0, high=0.9, step=0.05,
                        help="hybrid: Wanda-prune this share of each surviving expert's weights (0: HodgeCover alone)"),
                Control("reduce", "choice", "merge", choices=REDUCTIONS,
                        help="merge: fold each dropped expert into its most mergeable survivor; prune: drop it"),
                Control("edge_quantile", "float", 0.5, low=0.05, high=1.0, step=0.05,
                        help="level of the complex: pairs up to this quantile of the barriers are edges")]

    def __init__(self, num_experts: int, edge_quantile: float = 0.5, reduce: str = "merge", sparsity: float = 0.0,
                 allocation: str = "uniform"):
        edge_quantile = check_float("edge_quantile", edge_quantile, 0.0, 1.0)
        if edge_quantile == 0.0:
            raise ValueError("edge_quantile must be a number in (0, 1], got 0.0")
        if reduce not in REDUCTIONS:
            raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
        sparsity = check_float("sparsity", sparsity, 0.0, 1.0)
        if sparsity >= 1.0:
            raise ValueError(f"sparsity must be a number in [0, 1), got {sparsity!r}")
        super().__init__(num_experts=num_experts, edge_quantile=edge_quantile, reduce=reduce, sparsity=sparsity,
                         allocation=allocation)
        self.edge_quantile, self.reduce, self.sparsity = edge_quantile, reduce, sparsity

    def compress_layer(self, index, block, inputs):
        n, layer, target = block.num_experts, str(index), self.count_for(index)
        if target == n and self.sparsity == 0:
            return block  # nothing to do: the engine reports NoChange
        if target == n:  # the hybrid's pruning alone: every expert survives
            new = keep_experts(block, range(n))
            self.results.setdefault("kept", {})[layer] = list(range(n))
        else:
            new = self.reduce_layer(layer, block, inputs, target)
        if self.sparsity > 0:
            zeroed = wanda_prune_experts(new, inputs, self.sparsity)
            total = sum(p.numel() for p in new.experts.parameters())
            self.results.setdefault("zeroed", {})[layer] = round(zeroed / total, 4)
        return new

    def reduce_layer(self, layer: str, block, inputs, target: int):
        """The cover's survivors; the other experts merged into (or pruned in favour of) them."""
        n = block.num_experts
        barriers = MergeBarriers(block, inputs)
        kept, owner, diagnostics = hodge_cover_plan(barriers, n, target, self.edge_quantile)
        self.results.setdefault("kept", {})[layer] = sorted(kept)
        self.results.setdefault("hodge", {})[layer] = diagnostics
        if self.reduce == "prune":
            return keep_experts(block, kept)
        groups = [[s] + [e for e in range(n) if owner[e] == s and e != s] for s in sorted(kept)]
        self.results.setdefault("clusters", {})[layer] = groups  # the survivor first
        return merge_experts(block, groups, [[float(barriers.frequency[m]) for m in g] for g in groups])
