"""The modules of a Gemma 4 decoder layer as the zoo holds it (``zoo.architectures.gemma4``): the native MoE modules
gathered under one module, and the decoder layer that calls it."""
import torch
from torch import nn
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextDecoderLayer
from transformers.utils.deprecation import deprecate_kwarg

PARTS = ("router", "experts", "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2")


class Gemma4NativeMoe(nn.Module):
    """A native Gemma 4 layer's MoE modules, gathered under one module that computes what the layer does with them:
    ``post_norm(experts(pre_norm(x), router(x)))`` on the residual ``x``."""

    def __init__(self, router, experts, pre_feedforward_layernorm_2, post_feedforward_layernorm_2):
        super().__init__()
        self.router, self.experts = router, experts
        self.pre_feedforward_layernorm_2 = pre_feedforward_layernorm_2
        self.post_feedforward_layernorm_2 = post_feedforward_layernorm_2

    def forward(self, residual: torch.Tensor) -> torch.Tensor:
        flat = residual.reshape(-1, residual.shape[-1])
        _, weights, indices = self.router(flat)
        out = self.experts(self.pre_feedforward_layernorm_2(flat), indices, weights)
        return self.post_feedforward_layernorm_2(out.reshape(residual.shape))


class Gemma4ZooDecoderLayer(Gemma4TextDecoderLayer):
    """Gemma 4's decoder layer with its MoE part in one module, ``moe`` (called on the residual stream). A native
    layer becomes one in place (``adopt``); one built anew holds its native MoE modules at ``moe`` too."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        if self.enable_moe_block:
            self.moe = Gemma4NativeMoe(*(self._modules.pop(p) for p in PARTS))

    @classmethod
    def adopt(cls, layer: Gemma4TextDecoderLayer) -> None:
        """Turn a native MoE layer into this class in place: its four MoE modules gathered at ``moe``."""
        layer.moe = Gemma4NativeMoe(*(layer._modules.pop(p) for p in PARTS))
        layer.__class__ = cls

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(self, hidden_states, per_layer_input=None, shared_kv_states=None, position_embeddings=None,
                attention_mask=None, position_ids=None, cache=None, **kwargs):
        attended, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states),
                                     position_embeddings=position_embeddings, attention_mask=attention_mask,
                                     shared_kv_states=shared_kv_states, position_ids=position_ids, cache=cache,
                                     **kwargs)
        residual = hidden_states + self.post_attention_layernorm(attended)
        feed_forward = self.mlp(self.pre_feedforward_layernorm(residual))
        if self.enable_moe_block:  # the dense MLP's normed output plus the MoE block's, both read the residual
            feed_forward = self.post_feedforward_layernorm_1(feed_forward) + self.moe(residual)
        hidden_states = residual + self.post_feedforward_layernorm(feed_forward)
        if self.hidden_size_per_layer_input:
            gated = self.act_fn(self.per_layer_input_gate(hidden_states)) * per_layer_input
            hidden_states = hidden_states + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return hidden_states * self.layer_scalar
