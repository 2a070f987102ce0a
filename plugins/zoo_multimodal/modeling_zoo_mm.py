"""zoo_mm: a small decoder over image patch tokens, audio frame tokens and text tokens, with SparseMoE blocks.

Sequence: ``[image patches][audio frames][<bos> prompt answer <eos>]``, causal attention, absent modalities
masked out (``image_mask`` / ``audio_mask``) or left out (``pixel_values`` / ``audio_features`` None).
Light encoders (two linear layers with a GELU) project patches and log-mel frames to the hidden size; a
type embedding marks each token's modality. Visual tokens first pass a Parrot block (``language-conditioned``
router, conditioned on the prompt's embedding); each decoder layer's MLP is a SparseMoE with a
``hierarchical-modality`` router over ``modality-groups`` experts (MoHAVE). Logits are for the text tokens.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import MoeCausalLMOutputWithPast

from zoo.moe.layout import apply_attention, apply_layout, apply_modules, build_block, moe_layers, sync_layout
from zoo.moe import RoutingContext, SparseMoE, SwiGLUExperts, model_load_balancing_loss, routing_context
from zoo.moe.context import AUDIO, TEXT, VISION
from zoo.moe.init import init_zoo_module, initialize_missing_keys
from zoo_multimodal.configuration_zoo_mm import ZooMMConfig
from zoo_multimodal.hierarchical_modality import HierarchicalModality
from zoo_multimodal.language_conditioned import LanguageConditioned
from zoo_multimodal.modality_groups import ModalityGroupExperts


def default_block(config) -> SparseMoE:
    experts = ModalityGroupExperts(config.group_sizes, config.hidden_size, config.moe_intermediate_size,
                                   groups=config.groups)
    router = HierarchicalModality(config.hidden_size, experts.num_experts, config.num_experts_per_tok,
                                  group_sizes=config.group_sizes, top_groups=config.top_groups)
    return SparseMoE(router, experts)


def default_vision_block(config) -> SparseMoE | None:
    if not config.vision_experts:
        return None
    router = LanguageConditioned(config.hidden_size, config.vision_experts, config.vision_experts_per_tok)
    return SparseMoE(router, SwiGLUExperts(config.vision_experts, config.hidden_size, config.moe_intermediate_size))


class Encoder(nn.Module):
    """Project each patch / frame to the hidden size, add a learned position per token."""

    def __init__(self, in_features: int, tokens: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(in_features, hidden), nn.Linear(hidden, hidden)
        self.position = nn.Embedding(tokens, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x))) + self.position.weight


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.heads = config.num_attention_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x, allowed):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
        return self.o_proj(out.transpose(1, 2).reshape(b, s, h))


class DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = default_block(config)

    def forward(self, x, allowed):
        x = x + self.self_attn(self.input_layernorm(x), allowed)
        return x + self.mlp(self.post_attention_layernorm(x))


class ZooMMPreTrainedModel(PreTrainedModel):
    config_class = ZooMMConfig
    base_model_prefix = "model"
    _no_split_modules = ("DecoderLayer",)

    def _init_weights(self, module):
        super()._init_weights(module)
        init_zoo_module(module, self.config.initializer_range)

    def _initialize_missing_keys(self, is_quantized: bool) -> None:
        initialize_missing_keys(self, PreTrainedModel._initialize_missing_keys, is_quantized)


class ZooMMModel(ZooMMPreTrainedModel):
    def __init__(self, config: ZooMMConfig):
        super().__init__(config)
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h, padding_idx=config.pad_token_id)
        self.text_position = nn.Embedding(config.max_text_positions, h)
        self.modality = nn.Embedding(3, h)
        self.vision = Encoder(config.patch_size ** 2, (config.image_size // config.patch_size) ** 2, h)
        self.audio = Encoder(config.num_mel_bins, config.audio_frames, h)
        self.vision_moe = build_block(config.zoo_vision_moe, config.zoo_components) if config.zoo_vision_moe else default_vision_block(config)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(h, eps=config.rms_norm_eps)
        self.post_init()

    def embed(self, input_ids, attention_mask=None, pixel_values=None, image_mask=None, audio_features=None,
              audio_mask=None):
        """Input embeddings ``[B, S, H]``, the key mask ``[B, S]`` and each token's modality ``[S]``."""
        b, length = input_ids.shape
        ones = input_ids.new_ones(b)
        text_mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        words = self.embed_tokens(input_ids)
        parts, masks, kinds = [], [], []
        if pixel_values is not None:
            v = self.vision(pixel_values) + self.modality.weight[VISION]
            if self.vision_moe is not None:  # its router reads the prompt from the routing context
                visual = RoutingContext(prompt_embeds=words, prompt_mask=text_mask,
                                        modality=torch.full(v.shape[:2], VISION, device=v.device))
                with routing_context(visual):
                    v = v + self.vision_moe(v)
            parts.append(v)
            masks.append((image_mask if image_mask is not None else ones)[:, None].expand(-1, v.shape[1]))
            kinds.append(torch.full((v.shape[1],), VISION))
        if audio_features is not None:
            a = self.audio(audio_features) + self.modality.weight[AUDIO]
            parts.append(a)
            masks.append((audio_mask if audio_mask is not None else ones)[:, None].expand(-1, a.shape[1]))
            kinds.append(torch.full((a.shape[1],), AUDIO))
        parts.append(words + self.text_position.weight[:length] + self.modality.weight[TEXT])
        masks.append(text_mask)
        kinds.append(torch.full((length,), TEXT))
        return torch.cat(parts, 1), torch.cat(masks, 1), torch.cat(kinds).to(input_ids.device)

    def forward(self, input_ids, attention_mask=None, pixel_values=None, image_mask=None, audio_features=None,
                audio_mask=None, **kwargs):
        x, keys, kinds = self.embed(input_ids, attention_mask, pixel_values, image_mask, audio_features, audio_mask)
        b, s = keys.shape
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        allowed = (causal & keys.bool()[:, None, :]) | torch.eye(s, dtype=torch.bool, device=x.device)
        media = s - input_ids.shape[1]  # image patches and audio frames come first and have no token id
        ids = torch.cat([input_ids.new_full((b, media), -1), input_ids], 1)
        context = RoutingContext(input_ids=ids, positions=torch.arange(s, device=x.device).expand(b, s),
                                 attention_mask=keys, modality=kinds.expand(b, s))
        with routing_context(context):
            for layer in self.layers:
                x = layer(x, allowed)
        return self.norm(x), keys, kinds


class ZooMMForCausalLM(ZooMMPreTrainedModel):
    def __init__(self, config: ZooMMConfig):
        super().__init__(config)
        self.model = ZooMMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        apply_layout(self, config.zoo_layout)
        apply_attention(self, getattr(config, "zoo_attention", None))  # a router that wraps attention (mixture-of-heads)
        apply_modules(self, getattr(config, "zoo_modules", None))  # adapter modules outside the blocks
        if config.zoo_recipe is None:
            config.zoo_recipe = []
        self.post_init()

    def forward(self, input_ids, attention_mask=None, pixel_values=None, image_mask=None, audio_features=None,
                audio_mask=None, labels=None, output_router_logits=None, **kwargs):
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        layers = moe_layers(self)
        captured, top_ks, hooks = [], [], []  # a router may return no logits (token-hash): it has no balance term

        def record(router, args, routing):  # returns None: the routing goes on unchanged
            if routing.logits is not None:
                captured.append(routing.logits)
                top_ks.append(router.top_k)

        if output_router_logits:
            hooks = [moe.router.register_forward_hook(record) for _, moe in layers]
        try:
            hidden, keys, _ = self.model(input_ids, attention_mask, pixel_values, image_mask, audio_features,
                                         audio_mask)
        finally:
            for h in hooks:
                h.remove()
        logits = self.lm_head(hidden[:, -input_ids.shape[1]:])
        loss = aux = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        if output_router_logits:
            aux = model_load_balancing_loss(captured, top_ks, keys)
            if loss is not None:
                loss = loss + self.config.router_aux_loss_coef * aux
        return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux, logits=logits,
                                         router_logits=tuple(captured) if output_router_logits else None)

    @torch.no_grad()
    def answer_probs(self, inputs, candidates) -> torch.Tensor:
        """``[B, len(candidates)]``: the answer distribution over candidate token ids, read at each prompt's last
        token (inputs from the processor without answers)."""
        logits = self(**{k: v for k, v in inputs.items() if k != "labels"}).logits
        last = inputs["attention_mask"].sum(1) - 1
        at = logits[torch.arange(len(last)), last]
        return at[:, candidates].float().softmax(-1)

    def save_pretrained(self, save_directory, *args, model_card=None, **kwargs):
        """Record the current layouts, then save atomically, with the model card as README.md."""
        from zoo.io.atomic import atomic_directory
        from zoo.publishing.cards import card

        sync_layout(self)
        if self.model.vision_moe is not None:
            self.config.zoo_vision_moe = self.model.vision_moe.layout()
        from zoo.architectures import remote_code

        with atomic_directory(save_directory) as tmp:
            remote_code.write(self.config, tmp)  # auto_map: any transformers process opens the folder
            super().save_pretrained(tmp, *args, **kwargs)
            (model_card or card(self, summary=self.zoo_family.summary, path=save_directory)).save(os.path.join(tmp, "README.md"))
