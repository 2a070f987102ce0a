"""Tiny random configs of each supported family (hidden 64, 2-3 layers, 4-8 experts)."""
import torch
from transformers import (DeepseekV3Config, GptOssConfig, MixtralConfig, OlmoeConfig, Qwen2MoeConfig,
                          Qwen3MoeConfig)

COMMON = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_config(family: str):
    if family == "mixtral":
        return MixtralConfig(**COMMON, intermediate_size=96, num_hidden_layers=2, num_local_experts=4,
                             num_experts_per_tok=2)
    if family == "qwen2_moe":
        return Qwen2MoeConfig(**COMMON, intermediate_size=128, moe_intermediate_size=48,
                              shared_expert_intermediate_size=80, num_hidden_layers=3, num_experts=6,
                              num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1])
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**COMMON, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                              num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, head_dim=16)
    if family == "olmoe":
        return OlmoeConfig(**COMMON, intermediate_size=48, num_hidden_layers=2, num_experts=8,
                           num_experts_per_tok=2)
    if family == "deepseek_v3":
        return DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                                n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
                                topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                                kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                v_head_dim=16, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
                                eos_token_id=2, rope_interleave=True)
    if family == "gpt_oss":
        return GptOssConfig(**COMMON, intermediate_size=48, num_hidden_layers=2, num_local_experts=4,
                            num_experts_per_tok=2, head_dim=16, sliding_window=16,
                            layer_types=["sliding_attention", "full_attention"])
    if family in ("granitemoe", "granitemoeshared"):
        from transformers import GraniteMoeConfig, GraniteMoeSharedConfig

        shared = dict(shared_intermediate_size=40) if family == "granitemoeshared" else {}
        return (GraniteMoeSharedConfig if shared else GraniteMoeConfig)(
            **COMMON, intermediate_size=32, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
            embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=2.5, **shared)
    if family == "ernie4_5_moe":
        from transformers import Ernie4_5_MoeConfig

        return Ernie4_5_MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                                  moe_num_experts=6, moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=1,
                                  tie_word_embeddings=False)
    if family == "hunyuan_v1_moe":
        from transformers import HunYuanMoEV1Config

        return HunYuanMoEV1Config(**COMMON, intermediate_size=48, num_hidden_layers=2, num_experts=6, moe_topk=2,
                                  head_dim=16)
    if family == "dots1":
        from transformers import Dots1Config

        return Dots1Config(**{**COMMON, "num_key_value_heads": 4}, intermediate_size=96, moe_intermediate_size=32,
                           num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                           n_group=4, topk_group=2, first_k_dense_replace=1, norm_topk_prob=True,
                           routed_scaling_factor=2.0, sliding_window=None)
    if family == "glm4_moe":
        from transformers import Glm4MoeConfig

        return Glm4MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                             n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2,
                             first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=1.5,
                             use_qk_norm=True, attention_bias=True)
    if family == "deepseek_v2":
        from transformers import DeepseekV2Config

        return DeepseekV2Config(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                                n_shared_experts=2, num_experts_per_tok=2, first_k_dense_replace=1,
                                routed_scaling_factor=2.0, topk_method="greedy", kv_lora_rank=16, q_lora_rank=24,
                                qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8,
                                max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    raise KeyError(family)


FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"]


def tiny_native(family: str, seed: int = 0):
    """A randomly initialised native model. Router weights and biases get real spread (the families
    initialise some of them to zero, which would make routing ties and hide mistakes)."""
    from zoo.io.convert import family_of  # noqa: F401  (ensures plugins load)
    from zoo.components.registry import registry

    torch.manual_seed(seed)
    fam = registry.get("architecture", family).obj
    model = fam.model_class(tiny_config(family)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gate" in name or "router" in name or "bias" in name or "sinks" in name:
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0, 0.1)
    return model


def padded_batch():
    ids = torch.tensor([[5, 17, 33, 9, 70, 11, 3, 44], [0, 0, 0, 8, 21, 66, 12, 90]])
    mask = torch.tensor([[1] * 8, [0, 0, 0, 1, 1, 1, 1, 1]])
    return ids, mask


def reload_max_diff(model, ids, path) -> float:
    """Save ``model``, load it back through the Auto classes, and return the largest logit difference."""
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        logits = model(input_ids=ids).logits
        model.save_pretrained(path)
        again = AutoModelForCausalLM.from_pretrained(path).eval()(input_ids=ids).logits
    return (again - logits).abs().max().item()


def sequential(original, compressed, reference):
    """Layer-at-a-time calibration, as a reference sees it: layer i's value of ``reference(model)`` (a dict
    keyed by layer) computed on a copy of ``original`` whose MoE blocks before layer i are ``compressed``'s,
    so layer i sees the tokens the already compressed layers before it produce."""
    import copy

    from zoo.moe.layout import moe_layers

    out = {}
    for i, _ in moe_layers(original):
        hybrid = copy.deepcopy(original)
        for j in range(i):
            hybrid.model.layers[j].mlp = compressed.model.layers[j].mlp
        out[i] = reference(hybrid)[i]
    return out


def folder_tensors(folder) -> dict:
    """Every tensor of the safetensors files in a saved folder, by key."""
    import os

    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, f)))
    return out


def logits(model, ids):
    """fp32 logits of ``ids`` (no cache)."""
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


def greedy(model, ids, new_tokens: int):
    """Greedy tokens after ``ids`` (every position attended, pad id 0)."""
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0)


def rel(a, b) -> float:
    """Relative error of ``a`` against ``b`` (Frobenius norms)."""
    return ((a - b).norm() / b.norm()).item()


def reload_and_export_bit_for_bit(model, folder, auto_class, native_class, logits_of, want, native_state) -> None:
    """``model`` saved to ``folder/zoo`` reloads through ``auto_class`` as its own class with ``want``'s logits
    (``logits_of(model)``, 1e-5), and its native export loads through ``native_class`` with exactly
    ``native_state``."""
    model.save_pretrained(folder / "zoo")
    back = auto_class.from_pretrained(folder / "zoo").eval()
    assert type(back) is type(model) and rel(logits_of(back), want) <= 1e-5
    import zoo

    zoo.export(back, folder / "native")
    state = native_class.from_pretrained(folder / "native").eval().state_dict()
    assert state.keys() == native_state.keys() and all(torch.equal(state[k], v) for k, v in native_state.items())
