"""prune-reap: REAP, router-weighted expert activation pruning.

Saliency of expert j: the mean, over the calibration tokens whose top-k contains j, of the gate value
times the L2 norm of j's output. The lowest are dropped. Calibrating on one domain keeps what that
domain uses (domain pruning, "Half the Experts, All the Code").
"""
from zoo.moe.surgery import keep_experts
from zoo.stats import collect

from zoo_compressors.base import ExpertCountCompressor


class PruneReap(ExpertCountCompressor):
    name = "prune-reap"
    summary = "REAP: prune the experts with the lowest router-weighted activation norm on calibration data."
    paper = ("Lasby et al., REAP the Experts: Why Pruning Prevails for One-Shot MoE Compression, 2025, "
             "arXiv:2510.13999; Half the Experts, All the Code (2026) for domain pruning")
    card = "cards/prune-reap.md"
    space = "compression-lab"

    def statistics(self, model, batches):
        return collect(model, batches, desc="prune-reap: saliency")

    def rebuild(self, moe, stats):
        keep = stats.reap.argsort(descending=True, stable=True)[: self.num_experts]
        self.results.setdefault("kept", {})[str(stats.layer)] = sorted(keep.tolist())
        return keep_experts(moe, keep.tolist())
