"""GPT-OSS: biased router, softmax over the top-k logits, clamped SwiGLU experts stored transposed and
interleaved ([E, H, 2I] with gate/up alternating), biases on both projections."""
import torch
from transformers import GptOssConfig, GptOssForCausalLM
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

from zoo.architectures.family import Family


class GptOss(Family):
    name = "gpt_oss"
    summary = "GPT-OSS decoder (biased top-k router, clamped SwiGLU experts with biases)."
    paper = "OpenAI, gpt-oss-120b & gpt-oss-20b Model Card, 2025. arXiv:2508.10925"
    config_class, model_class, block_class = GptOssConfig, GptOssForCausalLM, GptOssMLP
    num_experts_key, intermediate_key = "num_local_experts", "intermediate_size"
    router_config_keys = ()
    renames = {}
    padding_bias_key = "router.bias"  # selection reads the biased logits: padded experts are never chosen

    def router_options(self, config):
        # softmax over the k kept logits == renormalised top-k of the full softmax
        return {"norm_topk_prob": True}

    def experts_options(self, config):
        return {"activation": "clamped-swiglu", "bias": True,
                "swiglu_limit": config.swiglu_limit, "swiglu_alpha": config.swiglu_alpha}

    def block_layout(self, config):
        layout = super().block_layout(config)
        layout["router_options"]["bias"] = True
        layout["returns_router_scores"] = True  # the decoder layer unpacks (hidden, scores)
        return layout

    def to_zoo_state(self, sd):
        sd = dict(sd)
        gu, gub = sd.pop("experts.gate_up_proj"), sd.pop("experts.gate_up_proj_bias")
        sd["experts.gate_up_proj"] = torch.cat([gu[..., ::2], gu[..., 1::2]], -1).transpose(1, 2).contiguous()
        sd["experts.gate_up_proj_bias"] = torch.cat([gub[..., ::2], gub[..., 1::2]], -1).contiguous()
        sd["experts.down_proj"] = sd["experts.down_proj"].transpose(1, 2).contiguous()
        return sd

    def to_native_state(self, sd):
        sd = dict(sd)
        gate, up = sd.pop("experts.gate_up_proj").transpose(1, 2).chunk(2, -1)
        sd["experts.gate_up_proj"] = torch.stack([gate, up], -1).flatten(-2).contiguous()
        gb, ub = sd.pop("experts.gate_up_proj_bias").chunk(2, -1)
        sd["experts.gate_up_proj_bias"] = torch.stack([gb, ub], -1).flatten(-2).contiguous()
        sd["experts.down_proj"] = sd["experts.down_proj"].transpose(1, 2).contiguous()
        return sd
