"""lora-experts: LoRA on the fused expert weights (``gate_up_proj``, ``down_proj``) through PEFT's
``target_parameters``, one low-rank update per expert, run grouped (see ``lora_grouped``).

``zoo.apply(model, "lora-experts", r=8, alpha=16)`` returns a real ``PeftModel``: ``save_pretrained`` writes a
PEFT adapter, ``PeftModel.from_pretrained(zoo.load(base), dir)`` reloads it (PEFT's folded path), ``load_adapter``
reloads it with the grouped path, and ``merge_and_unload()`` gives back a zoo model that ``zoo.export`` writes.
"""
from __future__ import annotations

from peft import LoraConfig, PeftModel, PeftModelForCausalLM

from zoo import Adapter
from zoo.moe.layout import block_prefix, moe_layers
from zoo.moe import SwiGLUExperts
from zoo_adapters.lora_grouped import TARGETS, ParamWrapper
from zoo.components.controls import Control


class ZooPeftModel(PeftModelForCausalLM):
    """A PeftModel of a zoo causal LM. Its ``.model`` is the decoder, as on the zoo's own causal LMs (PEFT would
    forward ``.model`` to the causal LM itself), so ``zoo.apply``, ``zoo.evaluation.eval`` and layouts see the MoE layers."""

    @property
    def model(self):
        return self.get_base_model().model


def lora_config(r: int, alpha: float, names: list[str]) -> LoraConfig:
    """PEFT config targeting the fused expert parameters by full name, built with the grouped wrapper."""
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=[], target_parameters=list(names),
                        task_type="CAUSAL_LM")
    config._register_custom_module({SwiGLUExperts: ParamWrapper})
    return config


def load_adapter(model, path, is_trainable: bool = False) -> ZooPeftModel:
    """Reload a saved lora-experts adapter onto ``model`` (e.g. ``zoo.load(base)``) with the grouped forward."""
    config = LoraConfig.from_pretrained(path)
    config._register_custom_module({SwiGLUExperts: ParamWrapper})
    config.inference_mode = not is_trainable
    peft_model = ZooPeftModel(model, config)
    peft_model.load_adapter(path, "default", is_trainable=is_trainable)
    return peft_model


class LoraExperts(Adapter):
    name = "lora-experts"
    summary = "LoRA on every expert's fused weights (PEFT target_parameters), grouped per expert: no E x out x in delta."
    paper = ("Hu et al., LoRA: Low-Rank Adaptation of Large Language Models, ICLR 2022, arXiv:2106.09685; "
             "PEFT target_parameters (Hugging Face PEFT >= 0.17)")
    card = "cards/lora-experts.md"
    space = "adapter-lab"

    @classmethod
    def demo_controls(cls, model=None):
        return [Control("r", "int", 8, low=1, high=64, step=1, help="LoRA rank"),
                Control("alpha", "float", 16.0, low=1.0, high=128.0, step=1.0, help="LoRA scale numerator"),
                Control("targets", "choice", "gate_up_proj,down_proj",
                        choices=("gate_up_proj,down_proj", "gate_up_proj", "down_proj"), help="expert weights adapted")]

    @classmethod
    def demo_presets(cls, model=None):
        return {"mild": {"r": 4, "alpha": 8.0}, "strong": {"r": 16, "alpha": 32.0}}

    def __init__(self, r: int = 8, alpha: float = 16.0, targets: str = "gate_up_proj,down_proj"):
        super().__init__(r=r, alpha=alpha, targets=targets)
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"r must be a positive integer, got {r!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
            raise ValueError(f"alpha must be a positive number, got {alpha!r}")
        self.targets = tuple(t.strip() for t in targets.split(",") if t.strip()) if isinstance(targets, str) else ()
        if not self.targets or not set(self.targets) <= set(TARGETS) or len(set(self.targets)) != len(self.targets):
            raise ValueError(f"targets must be a comma list of {', '.join(TARGETS)}, got {targets!r}")
        self.r, self.alpha = r, float(alpha)

    def attach(self, model):
        if isinstance(model, PeftModel):
            raise TypeError("the model already carries a PEFT adapter; merge_and_unload() it first")
        layers = moe_layers(model)
        if not layers:
            raise ValueError("lora-experts needs a model with MoE layers")
        odd = sorted({type(moe.experts).__name__ for _, moe in layers} - {"SwiGLUExperts"})
        if odd:
            raise ValueError(f"lora-experts adapts dense fused SwiGLU experts only, not {', '.join(odd)}")
        names = [f"{block_prefix(model, i)}experts.{t}" for i, _ in layers for t in self.targets]
        config = lora_config(self.r, self.alpha, names)
        config.base_model_name_or_path = model.__dict__.get("name_or_path") or None  # as get_peft_model does
        return ZooPeftModel(model, config)

    load_saved = staticmethod(load_adapter)  # zoo.load(adapter folder): the grouped forward, not PEFT's folded one

    def merge(self, model):
        """Fold the updates into the expert weights: a plain zoo model again."""
        return model.merge_and_unload()
