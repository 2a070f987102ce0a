"""hc-smoe: HC-SMoE, retraining-free merging of experts by hierarchical clustering.

Each expert is represented by its average output over all calibration tokens; experts are clustered
agglomeratively (average linkage by default, as the paper recommends; single and complete to compare)
into ``num_experts`` clusters; each cluster becomes one expert whose weights are the frequency-weighted
average of its members'. The router keeps one row per merged expert: the row of the cluster's most
frequently routed member (``router_rows="dominant"``) or the frequency-weighted average of the rows.
"""
import numpy as np
import torch

from zoo.moe.surgery import merge_experts

from zoo_compressors.base import ExpertCountCompressor
from zoo.demo_controls import Control

LINKAGES = ("average", "single", "complete")


def cluster_experts(features: torch.Tensor, n_clusters: int, method: str = "average") -> list[list[int]]:
    """Agglomerative clustering of the rows of ``features`` (Euclidean) into exactly ``n_clusters``."""
    from scipy.cluster.hierarchy import cut_tree, linkage  # imported on use: scipy is heavy for `import zoo`

    if n_clusters >= len(features):
        return [[i] for i in range(len(features))]
    tree = linkage(features.double().numpy(), method=method, metric="euclidean")
    labels = cut_tree(tree, n_clusters=n_clusters).reshape(-1)
    return [np.flatnonzero(labels == c).tolist() for c in range(n_clusters)]


class HcSmoe(ExpertCountCompressor):
    name = "hc-smoe"
    summary = "HC-SMoE: cluster experts by their mean outputs (hierarchical), merge each cluster by frequency."
    paper = ("Chen et al., Retraining-Free Merging of Sparse MoE via Hierarchical Clustering (HC-SMoE), "
             "ICML 2025, arXiv:2410.08589")
    card = "cards/hc-smoe.md"
    space = "compression-lab"
    all_outputs = True

    @classmethod
    def demo_controls(cls, model=None):
        return [*super().demo_controls(model),
                Control("linkage", "choice", "average", choices=LINKAGES, help="how clusters of experts are joined"),
                Control("router_rows", "choice", "dominant", choices=("dominant", "average"),
                        help="the merged expert's gate row")]

    def __init__(self, num_experts: int, linkage: str = "average", router_rows: str = "dominant"):
        if linkage not in LINKAGES:
            raise ValueError(f"linkage must be one of {LINKAGES}, got {linkage!r}")
        if router_rows not in ("dominant", "average"):
            raise ValueError(f"router_rows must be 'dominant' or 'average', got {router_rows!r}")
        super().__init__(num_experts=num_experts, linkage=linkage, router_rows=router_rows)
        self.linkage, self.router_rows = linkage, router_rows

    def rebuild(self, moe, stats):
        groups = cluster_experts(stats.mean_output, self.num_experts, self.linkage)
        freq = stats.counts.double() + 1e-9  # an expert never routed to still counts a little
        weights = [[float(freq[m]) for m in g] for g in groups]
        dominant = [max(g, key=lambda m: float(freq[m])) for g in groups]
        self.results.setdefault("clusters", {})[str(stats.layer)] = groups

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
