"""prune-reap: REAP, router-weighted expert activation pruning.

Saliency of expert j: the mean, over the calibration tokens whose top-k contains j, of the gate value
times the L2 norm of j's output. The lowest are dropped. Calibrating on one domain keeps what that
domain uses (domain pruning, "Half the Experts, All the Code").
"""
from zoo_compressors.base import ExpertPruner


class PruneReap(ExpertPruner):
    name = "prune-reap"
    summary = "REAP: prune the experts with the lowest router-weighted activation norm on calibration data."
    paper = ("Lasby et al., REAP the Experts: Why Pruning Prevails for One-Shot MoE Compression, 2025, "
             "arXiv:2510.13999; Half the Experts, All the Code (2026) for domain pruning")
    card = "cards/prune-reap.md"
    space = "compression-lab"

    def score(self, stats):
        return stats.reap
