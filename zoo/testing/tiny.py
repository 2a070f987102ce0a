"""Tiny seeded fp32 models of several families, their inputs and calibration data (what checks run on)."""
from __future__ import annotations

import copy

import torch


def _common(**extra) -> dict:
    return dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)


# family -> (config class name in transformers, its keyword arguments): 20-80 thousand parameters each. Widths are
# 32, the smallest quantization group; Qwen2-MoE and DeepSeek-V3 have a dense layer next to MoE ones and shared
# experts, GPT-OSS biased experts and a clamped activation.
TINY = {
    "mixtral": ("MixtralConfig", _common(intermediate_size=32, num_hidden_layers=2, num_local_experts=4,
                                         num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", _common(intermediate_size=64, moe_intermediate_size=32,
                                            shared_expert_intermediate_size=32, num_hidden_layers=3, num_experts=6,
                                            num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1])),
    "qwen3_moe": ("Qwen3MoeConfig", _common(intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", _common(intermediate_size=32, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)),
    "deepseek_v3": ("DeepseekV3Config", dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, rope_interleave=True)),
    "gpt_oss": ("GptOssConfig", _common(intermediate_size=32, num_hidden_layers=2, num_local_experts=4,
                                        num_experts_per_tok=2, sliding_window=16,
                                        layer_types=["sliding_attention", "full_attention"])),
    "mistral": ("MistralConfig", _common(intermediate_size=64, num_hidden_layers=2)),  # dense
    "zoo_mm": ("ZooMMConfig", dict(vocab_size=25, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   moe_intermediate_size=32, group_sizes=[2, 3, 3], top_groups=2,
                                   num_experts_per_tok=2, vision_experts=3)),
}


def tiny_model(family: str, seed: int = 0):
    """A seeded fp32 model of a built-in family (``TINY``), in eval mode: native for transformers' families, the
    zoo's own for ``zoo_mm``. Router weights and biases get real spread (some families start them at zero, which
    would make routing ties and hide mistakes)."""
    import transformers

    if family not in TINY:
        raise KeyError(f"no built-in tiny model of {family!r}; built in: {', '.join(TINY)}")
    config_name, kwargs = TINY[family]
    torch.manual_seed(seed)
    if family == "zoo_mm":
        from zoo_multimodal.configuration_zoo_mm import ZooMMConfig
        from zoo_multimodal.modeling_zoo_mm import ZooMMForCausalLM

        return ZooMMForCausalLM(ZooMMConfig(**kwargs)).eval()
    config = getattr(transformers, config_name)(**copy.deepcopy(kwargs))
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name or "sinks" in name or (("gate" in name or "router" in name) and "proj" not in name):
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0, 0.1)
    return model


def sample_inputs(model, seed: int = 0) -> dict:
    """Fixed inputs for ``model``: 2 rows of 8 token ids (no special token), plus image patches and audio frames
    for ``zoo_mm``."""
    config = model.config
    text = config.get_text_config()
    special = {v for c in (config, text) for k, v in c.to_dict().items()
               if isinstance(v, int) and not isinstance(v, bool) and ("token_id" in k or "token_index" in k)}
    allowed = torch.tensor([i for i in range(3, min(text.vocab_size, 100)) if i not in special])
    g = torch.Generator().manual_seed(seed)
    inputs = {"input_ids": allowed[torch.randint(len(allowed), (2, 8), generator=g)]}
    if config.model_type == "zoo_mm":
        patches = (config.image_size // config.patch_size) ** 2
        inputs["pixel_values"] = torch.randn(2, patches, config.patch_size ** 2, generator=g)
        inputs["audio_features"] = torch.randn(2, config.audio_frames, config.num_mel_bins, generator=g)
    if getattr(config, "is_encoder_decoder", False):  # a seq2seq model (Switch Transformers) decodes a prefix too
        inputs["decoder_input_ids"] = inputs["input_ids"][:, :6]
    if getattr(config, "canvas_length", None):  # a block-diffusion model (Diffusion Gemma): its canvas, else random
        inputs["decoder_input_ids"] = allowed[torch.randint(len(allowed), (2, config.canvas_length), generator=g)]
    return inputs


def calibration_for(model, seed: int = 0) -> list:
    """Small calibration data for ``model``: one batch of 4 x 16 random token ids inside its vocabulary."""
    vocab = model.config.get_text_config().vocab_size
    return [torch.randint(3, vocab, (4, 16), generator=torch.Generator().manual_seed(seed))]
