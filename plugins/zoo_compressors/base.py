"""What the pruning and merging compressors share: option checks, per-layer statistics, rebuilding blocks."""
from __future__ import annotations

from zoo import Compressor
from zoo.moe import SwiGLUExperts
from zoo.moe.experts import MLPExperts
from zoo.editing.stats import layer_stats
from zoo.components.controls import expert_fraction, num_experts_control


class ExpertCountCompressor(Compressor):
    """A compressor that leaves ``num_experts`` experts in every MoE layer, decided from the tokens that reach
    the layer (calibration data carried through the already compressed layers before it)."""

    needs_calibration = True
    inputs_for = ("compress",)
    all_outputs = False  # statistics need every expert's output on every token (merging), not only routed ones

    @classmethod
    def demo_controls(cls, model=None):
        return [num_experts_control(model)]

    @classmethod
    def demo_presets(cls, model=None):
        """mild: 3/4 of the layer's experts; strong: half of them."""
        return {"mild": {"num_experts": expert_fraction(model, 0.75, 6)},
                "strong": {"num_experts": expert_fraction(model, 0.5, 4)}}

    def __init__(self, num_experts: int, **options):
        if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
            raise ValueError(f"num_experts must be a positive integer, got {num_experts!r}")
        super().__init__(num_experts=num_experts, **options)
        self.num_experts = num_experts
        self.results: dict = {}  # recorded in the recipe step

    experts_kinds: tuple[type, ...] = (SwiGLUExperts, MLPExperts)  # dense experts, gated or not

    @property
    def experts_count_after(self) -> int:
        return self.num_experts

    def check_layer(self, index, block) -> None:
        if type(block.experts) not in self.experts_kinds:
            raise ValueError(f"layer {index} has {block.experts.name!r} experts; {self.name} needs dense experts "
                             f"(run it before steps that quantize, factor or specialise the experts)")
        if self.num_experts > block.num_experts:
            raise ValueError(f"num_experts={self.num_experts} but layer {index} has only {block.num_experts} experts")

    def compress_layer(self, index, block, inputs):
        return self.rebuild(block, layer_stats(index, block, inputs, all_outputs=self.all_outputs))

    def rebuild(self, moe, stats):  # pragma: no cover - abstract
        raise NotImplementedError


class ExpertPruner(ExpertCountCompressor):
    """Keep each layer's ``num_experts`` highest-scoring experts; a subclass only defines ``score``."""

    def score(self, stats):  # pragma: no cover - abstract
        raise NotImplementedError

    def rebuild(self, moe, stats):
        from zoo.moe.surgery import keep_experts

        keep = sorted(self.score(stats).double().argsort(descending=True, stable=True)[: self.num_experts].tolist())
        self.results.setdefault("kept", {})[str(stats.layer)] = keep
        return keep_experts(moe, keep)
