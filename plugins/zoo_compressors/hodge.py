"""HodgeCover's combinatorics: the mergeability 2-complex of a layer's experts, the Hodge decomposition of an edge
signal on it, and the greedy cover of weighted edges and triangles.

Conventions (the standard ones of combinatorial Hodge theory): vertices 0..n-1; an edge ``(i, j)`` with i < j is
oriented from i to j, so its column of the node-edge incidence ``B1 [n, m]`` holds -1 at i and +1 at j; a triangle
``(i, j, k)`` with i < j < k has boundary ``(j, k) - (i, k) + (i, j)`` in its column of ``B2 [m, t]``. Then
``B1 @ B2 == 0`` and every edge signal splits orthogonally as

    f = B1^T a  +  B2 c  +  h          (gradient, curl, harmonic; L1 h = 0 with L1 = B1^T B1 + B2 B2^T)

The harmonic part lives on the cycles of the edge graph that no filled triangle bounds: its dimension is the first
Betti number of the complex.
"""
from __future__ import annotations

import itertools

import torch


def edges_below(barrier: torch.Tensor, tau: float) -> list[tuple[int, int]]:
    """The pairs ``i < j`` whose barrier ``barrier[i, j]`` is at most ``tau`` (pairwise mergeable)."""
    n = barrier.shape[0]
    return [(i, j) for i, j in itertools.combinations(range(n), 2) if float(barrier[i, j]) <= tau]


def cliques(n: int, edges: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """The triples ``i < j < k`` whose three edges are all in ``edges`` (the candidate triangles)."""
    have = set(edges)
    return [(i, j, k) for i, j, k in itertools.combinations(range(n), 3)
            if (i, j) in have and (i, k) in have and (j, k) in have]


def boundary_matrices(n: int, edges: list[tuple[int, int]], triangles: list[tuple[int, int, int]]):
    """``(B1 [n, m], B2 [m, t])`` in float64, with the orientations of the module docstring."""
    b1 = torch.zeros(n, len(edges), dtype=torch.float64)
    for e, (i, j) in enumerate(edges):
        b1[i, e], b1[j, e] = -1.0, 1.0
    index = {edge: e for e, edge in enumerate(edges)}
    b2 = torch.zeros(len(edges), len(triangles), dtype=torch.float64)
    for t, (i, j, k) in enumerate(triangles):
        b2[index[(j, k)], t], b2[index[(i, k)], t], b2[index[(i, j)], t] = 1.0, -1.0, 1.0
    return b1, b2


def _project(a: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """The orthogonal projection of ``f`` onto the column space of ``a`` (rank-deficient ``a`` allowed)."""
    if a.shape[1] == 0 or a.shape[0] == 0:
        return torch.zeros_like(f)
    coef = torch.linalg.lstsq(a, f[:, None], driver="gelsd").solution  # least squares, minimum norm
    return (a @ coef)[:, 0]


def hodge_decomposition(b1: torch.Tensor, b2: torch.Tensor, f: torch.Tensor):
    """``(gradient, curl, harmonic)`` of the edge signal ``f [m]``: the least-squares projections of ``f`` onto
    im(B1^T) and im(B2), which are orthogonal because B1 B2 = 0, and what is left, which lies in ker(L1)."""
    f = f.double()
    gradient = _project(b1.T, f)
    curl = _project(b2, f)
    return gradient, curl, f - gradient - curl


def greedy_cover(n: int, budget: int, edge_weight: dict, triangle_weight: dict, tiebreak) -> list[int]:
    """Pick ``budget`` of the ``n`` vertices, one at a time, each the vertex that covers (touches) the largest
    weight of not yet covered edges and triangles; ties (and picks once everything is covered) go to the larger
    ``tiebreak[v]``, then the lower index. Returns the vertices in the order picked."""
    simplices = [(tuple(s), float(w)) for s, w in [*edge_weight.items(), *triangle_weight.items()] if w > 0]
    covered = [False] * len(simplices)
    kept: list[int] = []
    for _ in range(min(budget, n)):
        gain = [0.0] * n
        for (verts, w), done in zip(simplices, covered):
            if not done:
                for v in verts:
                    gain[v] += w
        best = max((v for v in range(n) if v not in kept), key=lambda v: (gain[v], float(tiebreak[v]), -v))
        kept.append(best)
        covered = [done or best in verts for (verts, _), done in zip(simplices, covered)]
    return kept
