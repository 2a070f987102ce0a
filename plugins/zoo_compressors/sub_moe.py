"""sub-moe: Sub-MoE, subspace expert merging.

Experts are clustered with K-means on their outputs over the calibration tokens. For each cluster and
projection, one SVD of the members' weights concatenated along the input dimension,
``[W_1 ... W_m] = U S [V_1^T ... V_m^T]``, gives a left subspace ``U`` shared by the cluster; the members'
right parts ``S V_e^T`` are merged by routing frequency, and the cluster's expert is ``U (sum_e f_e S V_e^T)``
at the kept rank (``rank_ratio`` of the full rank: below 1 the shared subspace is truncated).
"""
import torch

from zoo.moe.experts import SwiGLUExperts
from zoo.moe.surgery import router_like, place_like

from zoo_compressors.base import ExpertCountCompressor
from zoo.demo_controls import Control


def subspace_merge(weights: list[torch.Tensor], freq: torch.Tensor, rank_ratio: float) -> torch.Tensor:
    """Merge same-shape weights [out, in] through their shared left singular subspace."""
    out_dim, in_dim = weights[0].shape
    joint = torch.cat([w.double() for w in weights], dim=1)  # [out, m * in]
    u, s, vh = torch.linalg.svd(joint, full_matrices=False)
    r = max(1, round(rank_ratio * len(s)))
    u, s, vh = u[:, :r], s[:r], vh[:r]
    parts = (s[:, None] * vh).view(r, len(weights), in_dim)  # S V_e^T for each member e
    f = (freq.double() / freq.double().sum()).view(1, -1, 1)
    return u @ (parts * f).sum(1)


class SubMoe(ExpertCountCompressor):
    name = "sub-moe"
    summary = "Sub-MoE: K-means clusters of experts, one joint SVD per cluster (shared U), frequency-merged V."
    paper = "Li et al., Sub-MoE: Efficient Mixture-of-Expert LLMs Compression via Subspace Expert Merging, 2025, arXiv:2506.23266"
    card = "cards/sub-moe.md"
    space = "compression-lab"
    all_outputs = True
    experts_kinds = (SwiGLUExperts,)  # the joint SVD works on the fused gate/up projections

    @classmethod
    def demo_controls(cls, model=None):
        return [*super().demo_controls(model),
                Control("rank_ratio", "float", 1.0, low=0.05, high=1.0, step=0.05, help="rank kept of the shared basis")]

    def __init__(self, num_experts: int, rank_ratio: float = 1.0, seed: int = 0):
        if not isinstance(rank_ratio, (int, float)) or not 0 < rank_ratio <= 1:
            raise ValueError(f"rank_ratio must be in (0, 1], got {rank_ratio!r}")
        super().__init__(num_experts=num_experts, rank_ratio=rank_ratio, seed=seed)
        self.rank_ratio, self.seed = float(rank_ratio), int(seed)

    def clusters(self, stats) -> list[list[int]]:
        from sklearn.cluster import KMeans  # imported on use: scikit-learn is heavy for `import zoo`

        features = stats.mean_output.float().numpy()
        labels = KMeans(n_clusters=self.num_experts, n_init=10, random_state=self.seed).fit(features).labels_
        return [sorted(int(i) for i in (labels == c).nonzero()[0]) for c in range(self.num_experts)]

    @torch.no_grad()
    def rebuild(self, moe, stats):
        groups = self.clusters(stats)
        self.results.setdefault("clusters", {})[str(stats.layer)] = groups
        freq = stats.counts.double() + 1e-9
        old = moe.experts
        experts = SwiGLUExperts(**{**old.options(), "num_experts": len(groups)}).to(old.gate_up_proj.device)
        for g, members in enumerate(groups):
            for name in ("gate_up_proj", "down_proj"):
                w = getattr(old, name)
                merged = subspace_merge([w[m] for m in members], freq[members], self.rank_ratio)
                getattr(experts, name)[g] = merged.to(w.dtype)
            for name in ("gate_up_proj_bias", "down_proj_bias"):
                if getattr(old, name) is not None:
                    f = (freq[members] / freq[members].sum()).to(torch.float32)
                    getattr(experts, name)[g] = (getattr(old, name)[members].float() * f[:, None]).sum(0)
        experts.to(old.gate_up_proj.dtype)
        router = router_like(moe.router, len(groups))
        dominant = [max(g, key=lambda m: float(freq[m])) for g in groups]
        router.load_state_dict({k: (v[dominant] if v.dim() and v.shape[0] == moe.num_experts else v)
                                for k, v in moe.router.state_dict().items()})
        place_like(router, moe.router)
        return moe.with_parts(router, experts)
