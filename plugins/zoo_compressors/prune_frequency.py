"""prune-frequency: keep each layer's most often routed experts (the baseline of HC-SMoE and NAEE)."""
from zoo.moe.surgery import keep_experts
from zoo.stats import collect

from zoo_compressors.base import ExpertCountCompressor


class PruneFrequency(ExpertCountCompressor):
    name = "prune-frequency"
    summary = "Drop the least-routed experts per layer on calibration data (baseline)."
    paper = ("Chen et al., Retraining-Free Merging of Sparse MoE via Hierarchical Clustering (HC-SMoE), ICML 2025, "
             "arXiv:2410.08589 -- frequency pruning baseline")
    card = "cards/prune-frequency.md"
    space = "compression-lab"

    def statistics(self, model, batches):
        return collect(model, batches, desc="prune-frequency: counting routes")

    def rebuild(self, moe, stats):
        keep = stats.counts.double().argsort(descending=True, stable=True)[: self.num_experts]
        self.results.setdefault("kept", {})[str(stats.layer)] = sorted(keep.tolist())
        return keep_experts(moe, keep.tolist())
