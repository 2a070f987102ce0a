"""prune-frequency: keep each layer's most often routed experts (the baseline of HC-SMoE and NAEE)."""
from zoo_compressors.base import ExpertPruner


class PruneFrequency(ExpertPruner):
    name = "prune-frequency"
    summary = "Drop the least-routed experts per layer on calibration data (baseline)."
    paper = ("Chen et al., Retraining-Free Merging of Sparse MoE via Hierarchical Clustering (HC-SMoE), ICML 2025, "
             "arXiv:2410.08589 -- frequency pruning baseline")
    card = "cards/prune-frequency.md"
    space = "compression-lab"

    def score(self, stats):
        return stats.counts
