"""What the pruning and merging compressors share: option checks, calibration, rebuilding layers."""
from __future__ import annotations

from zoo import Compressor, calibration
from zoo.layout import moe_layers


class ExpertCountCompressor(Compressor):
    """A compressor that leaves ``num_experts`` experts in every MoE layer, decided from calibration data."""

    needs_calibration = True

    def __init__(self, num_experts: int, **options):
        if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
            raise ValueError(f"num_experts must be a positive integer, got {num_experts!r}")
        super().__init__(num_experts=num_experts, **options)
        self.num_experts = num_experts
        self.results: dict = {}  # recorded in the recipe step

    def check_model(self, model) -> None:
        """Reject a target the model cannot meet before anything is computed or changed."""
        for i, moe in moe_layers(model):
            if self.num_experts > moe.num_experts:
                raise ValueError(f"num_experts={self.num_experts} but layer {i} has only {moe.num_experts} experts")

    def calibration_batches(self, model, data):
        if data is None:
            data = calibration.corpus("mixed", tokens=8192)
        return calibration.batches(data, _tokenizer_for(model))

    def compress(self, model, calibration=None):
        self.check_model(model)
        stats = self.statistics(model, self.calibration_batches(model, calibration))
        base = model.model
        new = {i: self.rebuild(moe, st) for (i, moe), st in zip(moe_layers(model), stats)}
        for i, block in new.items():  # swap only when every layer succeeded
            base.layers[i].mlp = block
        return model

    def statistics(self, model, batches):  # pragma: no cover - abstract
        raise NotImplementedError

    def rebuild(self, moe, stats):  # pragma: no cover - abstract
        raise NotImplementedError


def _tokenizer_for(model):
    from zoo.data.tokenizer import load_tokenizer
    from zoo.registry import load_tokenizer as model_tokenizer

    try:
        return model_tokenizer(model.config._name_or_path)
    except Exception:
        return load_tokenizer()


class ExpertPruner(ExpertCountCompressor):
    """Keep each layer's ``num_experts`` highest-scoring experts; a subclass only defines ``score``."""

    def score(self, stats):  # pragma: no cover - abstract
        raise NotImplementedError

    def statistics(self, model, batches):
        from zoo.stats import collect

        return collect(model, batches, desc=f"{self.name}: calibrating")

    def rebuild(self, moe, stats):
        from zoo.moe.surgery import keep_experts

        keep = sorted(self.score(stats).double().argsort(descending=True, stable=True)[: self.num_experts].tolist())
        self.results.setdefault("kept", {})[str(stats.layer)] = keep
        return keep_experts(moe, keep)
