"""The layers of Diffusion Gemma as the zoo holds them (``zoo.architectures.diffusion_gemma``): each decoder layer's
MoE modules gathered at ``moe`` (as Gemma 4's), and each encoder layer calling its decoder twin's ``moe``, whose
tensors the native model ties to its own."""
import torch
from transformers.models.diffusion_gemma.modeling_diffusion_gemma import (DiffusionGemmaDecoderTextLayer,
                                                                          DiffusionGemmaEncoderTextLayer)
from transformers.utils.deprecation import deprecate_kwarg

from zoo.architectures.gemma4_modules import PARTS, Gemma4NativeMoe


class _ZooLayer:
    """The forward both stacks' layers share: attention, then the dense MLP's normed output plus the MoE block's
    (both read the residual), normed and added to it, the sum scaled."""

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None, cache=None,
                **kwargs):
        attended, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states),
                                     position_embeddings=position_embeddings, attention_mask=attention_mask,
                                     position_ids=position_ids, cache=cache, **kwargs)
        residual = hidden_states + self.post_attention_layernorm(attended)
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(residual)))
        hidden_states = residual + self.post_feedforward_layernorm(dense + self.moe_block()(residual))
        return hidden_states * self.layer_scalar


class DiffusionGemmaZooDecoderLayer(_ZooLayer, DiffusionGemmaDecoderTextLayer):
    """A decoder layer holding its MoE modules in one module, ``moe`` (a native layer becomes one in place)."""

    @classmethod
    def adopt(cls, layer: DiffusionGemmaDecoderTextLayer) -> None:
        layer.moe = Gemma4NativeMoe(*(layer._modules.pop(p) for p in PARTS))
        layer.__class__ = cls

    def moe_block(self) -> torch.nn.Module:
        return self.moe


class DiffusionGemmaZooEncoderLayer(_ZooLayer, DiffusionGemmaEncoderTextLayer):
    """An encoder layer without MoE modules of its own: it calls its decoder twin's block, whichever block a zoo
    component put there (the twin is a plain reference, so the block has one name and is saved once)."""

    @classmethod
    def adopt(cls, layer: DiffusionGemmaEncoderTextLayer, twin: DiffusionGemmaZooDecoderLayer) -> None:
        for part in PARTS:
            del layer._modules[part]
        object.__setattr__(layer, "twin", twin)  # not a submodule
        layer.__class__ = cls

    def moe_block(self) -> torch.nn.Module:
        return self.twin.moe
