"""The ``zoo_mm`` architecture spec: registers the config, model and processor with the Auto classes."""
from zoo.architectures.family import Family, NotExportable


class ZooMM(Family):
    name = "zoo_mm"
    summary = ("A small multimodal decoder (text + image patches + audio frames) with MoHAVE modality-group "
               "experts and Parrot language-conditioned visual experts.")
    paper = ("Kim et al., MoHAVE, ICML 2025, arXiv:2502.10447; Sun et al., Parrot: Multilingual Visual "
             "Instruction Tuning, ICML 2025, arXiv:2406.02539")
    card = "cards/zoo_mm.md"
    space = "multimodal-digits"
    aux_loss = True

    def __init__(self):
        from zoo_multimodal.configuration_zoo_mm import ZooMMConfig
        from zoo_multimodal.modeling_zoo_mm import ZooMMForCausalLM

        self.config_class, self.model_class = ZooMMConfig, ZooMMForCausalLM
        ZooMMForCausalLM.zoo_family = self  # how the zoo recognises a zoo_mm model (cards, apply, export)

    def native_config(self, config, layout):
        raise NotExportable("zoo_mm is the zoo's own architecture: transformers has no native family to export to")

    def register_auto_classes(self) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoProcessor

        from zoo_multimodal.processing_zoo_mm import ZooMMProcessor

        AutoConfig.register("zoo_mm", self.config_class, exist_ok=True)
        AutoModelForCausalLM.register(self.config_class, self.model_class, exist_ok=True)
        AutoProcessor.register(self.config_class, ZooMMProcessor, exist_ok=True)
