"""sub-moe: Sub-MoE, subspace expert merging.

Adaptive expert clustering (the paper's, ``clustering="cosine"``): the similarity of two experts is the cosine of
their outputs on the same calibration token, averaged over the tokens; K-means on each expert's row of that
similarity matrix groups the experts. ``clustering="euclidean"`` is the zoo's earlier variant: K-means on the
experts' mean outputs.

Subspace merging: for each cluster and projection, one SVD of the members' weights concatenated along the input
dimension, ``[W_1 ... W_m] = U S [V_1^T ... V_m^T]``, gives a left subspace ``U`` shared by the cluster; the members'
right parts ``S V_e^T`` are merged by routing frequency, and the cluster's expert is ``U (sum_e f_e S V_e^T)``.
Intra-expert compression keeps ``rank_ratio`` of the joint rank. The default, 1.0, keeps it all: the shared basis is
complete and the merge is exactly the frequency-weighted average of the members (up to float rounding). Below 1.0 the
merged expert is the average projected onto the top of the shared subspace, but it is still stored dense, as
``U V``: a truncated rank loses information and saves no bytes here (the zoo has no per-expert low-rank storage; the
``factored`` experts of moe-svd share one ``V`` per layer). The results record, per layer, the parameters of the
dense merged experts and what their factored form (``U`` and the merged ``V`` at the kept rank) would hold.

The router keeps all its rows, each original expert served by its cluster's merged expert (``router="map"``, as
hc-smoe); ``router="cut"`` keeps one row per cluster (its most routed member's).
"""
import torch

from zoo.moe.experts import SwiGLUExperts
from zoo.moe.surgery import merge_experts
from zoo.editing.stats import block_expert_output, layer_stats

from zoo_compressors.base import ExpertCountCompressor
from zoo.components.controls import Control

CLUSTERINGS = ("cosine", "euclidean")
ROUTERS = ("map", "cut")


def subspace_merge(weights: list[torch.Tensor], freq: torch.Tensor, rank_ratio: float) -> torch.Tensor:
    """Merge same-shape weights [out, in] through their shared left singular subspace."""
    u, parts, r = subspace_parts(weights, freq, rank_ratio)
    return u @ parts


def merge_cluster(weights: list[torch.Tensor], freq: torch.Tensor, rank_ratio: float):
    """(the cluster's merged weight [out, in] in float64, the parameters of its factored form at the kept rank). At
    the whole joint rank the shared basis is complete (U U^T W_e = W_e for every member), so ``U (sum_e f_e S V_e^T)``
    is the frequency-weighted average itself, taken without the SVD (of a joint [2I, m H] in float64: ~10^14
    operations per cluster and projection at Mixtral's sizes); below it, ``subspace_parts``."""
    out_dim, in_dim = weights[0].shape
    full = min(out_dim, len(weights) * in_dim)  # the joint matrix's rank at most: its singular values' count
    if max(1, round(rank_ratio * full)) == full:
        f = freq.double() / freq.double().sum()
        return sum(w.double() * x for w, x in zip(weights, f)), full * (out_dim + in_dim)
    u, v, r = subspace_parts(weights, freq, rank_ratio)
    return u @ v, u.numel() + v.numel()


def subspace_parts(weights: list[torch.Tensor], freq: torch.Tensor, rank_ratio: float):
    """(shared U [out, r], merged V part [r, in], r): the factored form of ``subspace_merge`` (the SVD at every
    rank: the reference of ``merge_cluster``)."""
    out_dim, in_dim = weights[0].shape
    joint = torch.cat([w.double() for w in weights], dim=1)  # [out, m * in]
    u, s, vh = torch.linalg.svd(joint, full_matrices=False)
    r = max(1, round(rank_ratio * len(s)))
    u, s, vh = u[:, :r], s[:r], vh[:r]
    parts = (s[:, None] * vh).view(r, len(weights), in_dim)  # S V_e^T for each member e
    f = (freq.double() / freq.double().sum()).view(1, -1, 1)
    return u, (parts * f).sum(1), r


@torch.no_grad()
def output_similarity(moe, x: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """[E, E]: the cosine of experts i and j's outputs on the same token, averaged over the tokens ``x [T, H]``."""
    n = moe.num_experts
    total = torch.zeros(n, n, dtype=torch.float64)
    for part in moe.expert_inputs(x).split(chunk):
        outs = torch.stack([block_expert_output(moe, e, part) for e in range(n)])  # [E, t, H]
        unit = outs / outs.norm(dim=-1, keepdim=True).clamp(min=1e-12)
        total += torch.einsum("ith,jth->ij", unit, unit)
    return total / max(1, x.shape[0])


class SubMoe(ExpertCountCompressor):
    name = "sub-moe"
    summary = ("Sub-MoE: K-means clusters of experts by output cosine similarity, one joint SVD per cluster "
               "(shared U), frequency-merged V (rank_ratio below 1 truncates it, stored dense).")
    paper = "Li et al., Sub-MoE: Efficient Mixture-of-Expert LLMs Compression via Subspace Expert Merging, 2025, arXiv:2506.23266"
    card = "cards/sub-moe.md"
    space = "compression-lab"
    all_outputs = False
    experts_kinds = (SwiGLUExperts,)  # the joint SVD works on the fused gate/up projections

    @classmethod
    def demo_controls(cls, model=None):
        return [*super().demo_controls(model),
                Control("rank_ratio", "float", 1.0, low=0.05, high=1.0, step=0.05,
                        help="rank kept of the shared basis (1.0: plain frequency-weighted averaging; below, a "
                             "truncated merge, still stored dense: no bytes saved)"),
                Control("clustering", "choice", "cosine", choices=CLUSTERINGS,
                        help="cosine: K-means on output cosine similarity (the paper's); euclidean: on mean outputs"),
                Control("router", "choice", "map", choices=ROUTERS,
                        help="map: the router keeps every row; cut: one row per merged expert")]

    def __init__(self, num_experts: int, rank_ratio: float = 1.0, clustering: str = "cosine", router: str = "map",
                 seed: int = 0, allocation: str = "uniform"):
        if isinstance(rank_ratio, bool) or not isinstance(rank_ratio, (int, float)) or not 0 < rank_ratio <= 1:
            raise ValueError(f"rank_ratio must be in (0, 1], got {rank_ratio!r}")
        if clustering not in CLUSTERINGS:
            raise ValueError(f"clustering must be one of {CLUSTERINGS}, got {clustering!r}")
        if router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        super().__init__(num_experts=num_experts, rank_ratio=rank_ratio, clustering=clustering, router=router,
                         seed=seed, allocation=allocation)
        self.rank_ratio, self.clustering, self.router, self.seed = float(rank_ratio), clustering, router, int(seed)

    def check_layer(self, index, block) -> None:
        super().check_layer(index, block)
        if self.router == "cut" and block.expert_map is not None:
            raise ValueError(f"layer {index} already serves its router's {block.router.num_experts} rows with "
                             f"{block.num_experts} merged experts: router='cut' needs one row per expert")

    def compress_layer(self, index, block, inputs):
        stats = layer_stats(index, block, inputs, all_outputs=self.clustering == "euclidean")
        features = (output_similarity(block, inputs) if self.clustering == "cosine" else stats.mean_output)
        return self.rebuild(block, stats, features)

    def clusters(self, features: torch.Tensor, count: int) -> list[list[int]]:
        from sklearn.cluster import KMeans  # imported on use: scikit-learn is heavy for `import zoo`

        if count >= len(features):
            return [[i] for i in range(len(features))]
        labels = KMeans(n_clusters=count, n_init=10, random_state=self.seed).fit(features.float().cpu().numpy()).labels_
        return [sorted(int(i) for i in (labels == c).nonzero()[0]) for c in range(count)]

    @torch.no_grad()
    def rebuild(self, moe, stats, features):
        groups = self.clusters(features, self.count_for(stats.layer))
        layer = str(stats.layer)
        self.results.setdefault("clusters", {})[layer] = groups
        freq = stats.counts.double() + 1e-9
        old = moe.experts
        experts = SwiGLUExperts(**{**old.options(), "num_experts": len(groups)}).to(old.gate_up_proj.device)
        dense = factored = 0
        for g, members in enumerate(groups):
            for name in ("gate_up_proj", "down_proj"):
                w = getattr(old, name)
                merged, stored = merge_cluster([w[m] for m in members], freq[members], self.rank_ratio)
                getattr(experts, name)[g] = merged.to(w.dtype)
                dense += w[0].numel()
                factored += min(stored, w[0].numel())
            for name in ("gate_up_proj_bias", "down_proj_bias"):
                if getattr(old, name) is not None:
                    f = (freq[members] / freq[members].sum()).to(torch.float32)
                    getattr(experts, name)[g] = (getattr(old, name)[members].float() * f[:, None]).sum(0)
        experts.to(old.gate_up_proj.dtype)
        self.results.setdefault("parameters", {})[layer] = {"dense": dense, "factored_at_rank": factored}
        weights = [[float(freq[m]) for m in g] for g in groups]
        if self.router == "map":
            return merge_experts(moe, groups, weights, experts=experts)
        dominant = [max(g, key=lambda m: float(freq[m])) for g in groups]
        return merge_experts(moe, groups, weights, experts=experts, router_rows=lambda state, mix: {
            k: (v[dominant] if v.dim() and v.shape[0] == moe.num_experts else v) for k, v in state.items()})
