"""hc-smoe: HC-SMoE, retraining-free merging of experts by hierarchical clustering.

Each expert is represented by its average output over all calibration tokens; experts are clustered
agglomeratively (average linkage by default, as the paper recommends; single and complete to compare)
into ``num_experts`` clusters; each cluster becomes one expert whose weights are the frequency-weighted
average of its members'.

The router (``router="map"``, the default: the authors' code) keeps all its E rows and picks among the
original experts as before; each original expert is served by its cluster's merged expert (an expert map in
the layout; two picks served by the same merged expert run it once with their weights summed).
``router="cut"`` is the zoo's own variant: one router row per cluster, the row of its most frequently routed
member (``router_rows="dominant"``) or the frequency-weighted average of its members' rows (``"average"``).
"""
import numpy as np
import torch

from zoo.moe.surgery import merge_experts

from zoo_compressors.base import ExpertCountCompressor
from zoo.components.controls import Control

LINKAGES = ("average", "single", "complete")
ROUTERS = ("map", "cut")
ROUTER_ROWS = ("dominant", "average")


def cluster_experts(features: torch.Tensor, n_clusters: int, method: str = "average") -> list[list[int]]:
    """Agglomerative clustering of the rows of ``features`` (Euclidean) into exactly ``n_clusters``."""
    from scipy.cluster.hierarchy import cut_tree, linkage  # imported on use: scipy is heavy for `import zoo`

    if n_clusters >= len(features):
        return [[i] for i in range(len(features))]
    tree = linkage(features.double().cpu().numpy(), method=method, metric="euclidean")
    labels = cut_tree(tree, n_clusters=n_clusters).reshape(-1)
    return [np.flatnonzero(labels == c).tolist() for c in range(n_clusters)]


class HcSmoe(ExpertCountCompressor):
    name = "hc-smoe"
    summary = ("HC-SMoE: cluster experts by their mean outputs (hierarchical), merge each cluster by frequency; the "
               "router keeps its rows, each served by its cluster's expert.")
    paper = ("Chen et al., Retraining-Free Merging of Sparse MoE via Hierarchical Clustering (HC-SMoE), "
             "ICML 2025, arXiv:2410.08589")
    card = "cards/hc-smoe.md"
    space = "compression-lab"
    all_outputs = True

    @classmethod
    def demo_controls(cls, model=None):
        return [*super().demo_controls(model),
                Control("linkage", "choice", "average", choices=LINKAGES, help="how clusters of experts are joined"),
                Control("router", "choice", "map", choices=ROUTERS,
                        help="map: the router keeps every row (the paper's); cut: one row per merged expert")]

    def __init__(self, num_experts: int, linkage: str = "average", router: str = "map", router_rows: str = "dominant",
                 allocation: str = "uniform"):
        if linkage not in LINKAGES:
            raise ValueError(f"linkage must be one of {LINKAGES}, got {linkage!r}")
        if router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
        if router_rows not in ROUTER_ROWS:
            raise ValueError(f"router_rows must be 'dominant' or 'average', got {router_rows!r}")
        if router == "map" and router_rows != "dominant":
            raise ValueError("router_rows chooses the cut router's rows: it needs router='cut' (router='map' keeps "
                             "every row)")
        super().__init__(num_experts=num_experts, linkage=linkage, router=router, router_rows=router_rows,
                         allocation=allocation)
        self.linkage, self.router, self.router_rows = linkage, router, router_rows

    def check_layer(self, index, block) -> None:
        super().check_layer(index, block)
        if self.router == "cut" and block.expert_map is not None:
            raise ValueError(f"layer {index} already serves its router's {block.router.num_experts} rows with "
                             f"{block.num_experts} merged experts: router='cut' needs one row per expert")

    def rebuild(self, moe, stats):
        groups = cluster_experts(stats.mean_output, self.count_for(stats.layer), self.linkage)
        freq = stats.counts.double() + 1e-9  # an expert never routed to still counts a little
        weights = [[float(freq[m]) for m in g] for g in groups]
        self.results.setdefault("clusters", {})[str(stats.layer)] = groups
        if self.router == "map":
            return merge_experts(moe, groups, weights)
        dominant = [max(g, key=lambda m: float(freq[m])) for g in groups]

        def router_rows(state, mix):
            out = {}
            for key, value in state.items():
                if value.dim() and value.shape[0] == moe.num_experts:
                    out[key] = (value[dominant] if self.router_rows == "dominant"
                                else torch.einsum("ne,e...->n...", mix.to(value.dtype), value))
                else:
                    out[key] = value
            return out

        return merge_experts(moe, groups, weights, router_rows)
