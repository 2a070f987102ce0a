"""What the pruning and merging compressors share: option checks, per-layer statistics, rebuilding blocks."""
from __future__ import annotations

from zoo import Compressor
from zoo.moe import SwiGLUExperts
from zoo.moe.experts import MLPExperts
from zoo.editing.stats import layer_stats
from zoo.components.controls import expert_fraction, num_experts_control
from zoo_compressors.budgets import check_allocation, error_counts, error_curve, floor_of, global_counts


class ExpertCountCompressor(Compressor):
    """A compressor that leaves ``num_experts`` experts in every MoE layer, decided from the tokens that reach
    the layer (calibration data carried through the already compressed layers before it).

    ``allocation`` other than "uniform" makes ``num_experts`` the average: the total ``num_experts x layers`` is
    shared out across layers (``zoo_compressors.budgets``) by a statistics pass over every layer before any changes
    ("global": the method's scores ranked across layers; "error": the split of least summed output error; "search":
    an evolutionary search scored by the model's loss, in memory only), and the result is a layout of different
    expert counts per layer."""

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

    def __init__(self, num_experts: int, allocation: str = "uniform", **options):
        if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
            raise ValueError(f"num_experts must be a positive integer, got {num_experts!r}")
        check_allocation(allocation)
        super().__init__(num_experts=num_experts, **({"allocation": allocation} if allocation != "uniform" else {}),
                         **options)
        self.num_experts, self.allocation = num_experts, allocation
        self.results: dict = {}  # recorded in the recipe step
        if allocation != "uniform":  # a statistics pass over every layer first, with the layers' inputs
            self.needs_plan, self.inputs_for = True, ("observe", "compress")
        # the search scores whole-model losses: plan() gets the model and its calibration batches, streaming refuses it
        self.plan_needs_model = allocation == "search"
        self._budget_scores: dict[int, object] = {}
        self._curves: dict[int, dict[int, float]] = {}
        self._floors: dict[int, int] = {}
        self._counts: dict[int, int] = {}

    experts_kinds: tuple[type, ...] = (SwiGLUExperts, MLPExperts)  # dense experts, gated or not

    @property
    def experts_count_after(self) -> int:
        # shared out per layer, a layer may end with as few as one expert: later steps are judged on that
        return self.num_experts if self.allocation == "uniform" else 1

    def count_for(self, layer: int) -> int:
        """How many experts layer ``layer`` keeps (``num_experts``, or its share of the total)."""
        return self._counts.get(layer, self.num_experts)

    def budget_score(self, stats):
        """What ranks experts for the budgets: how often the router picks them (pruners rank by their own score)."""
        return stats.counts

    def observe(self, index, block, inputs):
        stats = layer_stats(index, block, inputs)
        score = self.budget_score(stats)
        self._budget_scores[index], self._floors[index] = score, floor_of(block, self.num_experts)
        if self.allocation in ("error", "search"):
            order = score.double().argsort(descending=True, stable=True).tolist()
            self._curves[index] = error_curve(block, inputs, order, self._floors[index])

    def plan(self, model=None, inputs=None):
        total = self.num_experts * len(self._budget_scores)
        if self.allocation == "global":
            self._counts = global_counts(self._budget_scores, total, self._floors)
        elif self.allocation == "error":
            self._counts = error_counts(self._curves, total)
            self.results["output_error"] = {str(i): round(self._curves[i][n], 6) for i, n in self._counts.items()}
        else:
            self._counts = self.search(model, inputs, total)
        self.results["experts_per_layer"] = {str(i): n for i, n in sorted(self._counts.items())}
        self._budget_scores, self._curves = {}, {}

    def search(self, model, inputs, total: int) -> dict[int, int]:
        """allocation="search": the split of least calibration loss, each layer keeping its best experts by the
        method's score, searched from the uniform, global and error splits (``budgets.search_counts``). Scored on
        the model as it is before this recipe's steps run (the engine changes nothing until every layer is done)."""
        from tqdm.auto import tqdm

        from zoo_compressors.budgets import search_counts, search_loss

        floors = self._floors
        caps = {i: len(self._budget_scores[i]) for i in floors}
        starts = [{i: self.num_experts for i in floors}, global_counts(self._budget_scores, total, floors),
                  error_counts(self._curves, total)]
        orders = {i: s.double().argsort(descending=True, stable=True).tolist() for i, s in self._budget_scores.items()}
        loss = search_loss(model, inputs.batches, orders)
        with tqdm(desc=f"{self.name}: searching per-layer budgets", unit="split", leave=False) as bar:
            counts, best, scored = search_counts(loss, starts, floors, caps, progress=bar)
        self.results["search"] = {"candidates": len(scored), "calibration_loss": round(best, 5),
                                  "uniform_loss": round(scored[tuple(self.num_experts for _ in sorted(floors))], 5)}
        return counts

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

    def budget_score(self, stats):
        return self.score(stats)

    def rebuild(self, moe, stats):
        from zoo.moe.surgery import keep_experts

        keep = sorted(self.score(stats).double().argsort(descending=True, stable=True)[: self.count_for(stats.layer)]
                      .tolist())
        self.results.setdefault("kept", {})[str(stats.layer)] = keep
        return keep_experts(moe, keep)
