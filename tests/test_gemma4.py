"""Gemma 4's MoE models: the router, experts and their two norms sit in the decoder layer beside a dense MLP; the zoo
holds them as one SparseMoE at the layer's ``moe`` (router ``gemma4-topk`` on the residual, experts behind the block's
input norm, the block's output norm after them). Converted losslessly, reloaded, exported back to Gemma 4's own
layout, changed by the zoo."""
import torch
from transformers import AutoModelForCausalLM, Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration
from transformers import Gemma4TextConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRouter

import zoo
from tiny import greedy as greedy_of, logits as logits_of, rel
from families.tiny_configs import TINY
from zoo.components.registry import registry
from zoo.moe.layout import moe_layers, replace_blocks
from zoo.moe.surgery import keep_experts

IDS = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(1))
CAL = [torch.randint(3, 100, (4, 16), generator=torch.Generator().manual_seed(2))]
MOE_KEYS = ("router.proj.weight", "router.scale", "router.per_expert_scale", "experts.gate_up_proj",
            "experts.down_proj", "pre_feedforward_layernorm_2.weight", "post_feedforward_layernorm_2.weight")


def spread(model):
    """Router scales, per-expert scales and norm weights away from their initial ones, so each one counts."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("scale", "layernorm_2.weight", "layernorm_1.weight")):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif name.endswith("router.proj.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
    return model


def native_text(seed=0):
    """The tiny Gemma 4 text model of the families' list, experts 32 wide (the quantizer's group)."""
    torch.manual_seed(seed)
    return spread(Gemma4ForCausalLM(Gemma4TextConfig(**{**TINY["gemma4_text"], "moe_intermediate_size": 32})).eval())


def logits(model, ids=IDS):
    return logits_of(model, ids)


def greedy(model):
    return greedy_of(model, IDS[:1], 6)


def test_the_router_computes_gemma4s_router():
    config = Gemma4TextConfig(**{**TINY["gemma4_text"], "num_experts": 6, "top_k_experts": 3})
    native = spread(Gemma4TextRouter(config))
    router = registry.get("router", "gemma4-topk").obj(32, 6, 3, eps=config.rms_norm_eps)
    router.load_state_dict({"weight": native.proj.weight, "scale": native.scale,
                            "per_expert_scale": native.per_expert_scale})
    x = torch.randn(20, 32, generator=torch.Generator().manual_seed(0)) * 3
    with torch.no_grad():
        probs, want_w, want_i = native(x)
        got, ref = router(x), router.reference(x)
    assert torch.equal(got.indices, want_i) and torch.allclose(got.weights, want_w, rtol=1e-6, atol=1e-7)
    assert torch.equal(ref.indices, got.indices) and torch.allclose(ref.weights, got.weights, rtol=1e-5, atol=1e-6)
    assert torch.allclose(got.logits.softmax(-1), probs, rtol=1e-6, atol=1e-7)


def test_converts_losslessly_reloads_and_exports_gemma4s_layout(tmp_path):
    native = native_text()
    want, want_tokens, want_state = logits(native), greedy(native), dict(native.state_dict())
    model = zoo.convert(native)
    layer = model.model.layers[0]
    assert [i for i, _ in moe_layers(model)] == [0, 1]
    assert not any(hasattr(layer, name) for name in ("router", "experts", "pre_feedforward_layernorm_2"))
    moe = layer.moe
    assert moe.router.name == "gemma4-topk" and moe.input_norm.style == "weight-in-fp32"
    assert rel(logits(model), want) <= 1e-5
    assert torch.equal(greedy(model), want_tokens)

    model.save_pretrained(tmp_path / "zoo")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "zoo").eval()
    assert type(back) is type(model) and back.config.zoo_layout == model.config.zoo_layout
    assert rel(logits(back), want) <= 1e-5

    zoo.export(back, tmp_path / "native")
    again = Gemma4ForCausalLM.from_pretrained(tmp_path / "native").eval()
    assert type(again) is Gemma4ForCausalLM
    state = again.state_dict()
    assert all(f"model.layers.{i}.{key}" in state for i in (0, 1) for key in MOE_KEYS)
    assert all(torch.equal(state[k], want_state[k]) for k in want_state)  # every tensor back as it was
    assert rel(logits(again), want) <= 1e-5


def test_zoo_components_change_it_and_it_reloads(tmp_path, one_thread):
    model = zoo.convert(native_text())
    # Gemma 4's layers take their per-layer inputs as a positional argument: the engine carries them
    zoo.apply(model, "prune-frequency", calibration=CAL, num_experts=3)
    assert all(moe.num_experts == 3 for _, moe in moe_layers(model))
    zoo.apply(model, "expert-choice")
    zoo.apply(model, "quantize", bits=8, group_size=32)
    assert all(moe.router.name == "expert-choice" and moe.experts.name == "quantized" for _, moe in moe_layers(model))
    assert all(moe.input_norm is not None and moe.output_norm is not None for _, moe in moe_layers(model))
    out = logits(model)
    assert torch.isfinite(out).all()
    model.save_pretrained(tmp_path / "changed")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "changed").eval()
    assert [s["name"] for s in back.config.zoo_recipe] == ["prune-frequency", "expert-choice", "quantize"]
    assert rel(logits(back), out) <= 1e-5


def test_pruned_experts_export_with_their_scales(tmp_path):
    model = zoo.convert(native_text())
    replace_blocks(model, {i: keep_experts(moe, [0, 2, 3]) for i, moe in moe_layers(model)})
    want = logits(model)
    zoo.export(model, tmp_path / "native")
    again = Gemma4ForCausalLM.from_pretrained(tmp_path / "native").eval()
    assert again.config.num_experts == 3 and again.model.layers[0].router.per_expert_scale.shape == (3,)
    assert rel(logits(again), want) <= 1e-5


def test_the_vision_language_models_language_layers_convert():
    torch.manual_seed(0)
    values = {**TINY["gemma4"], "text_config": {**TINY["gemma4"]["text_config"], "moe_intermediate_size": 32}}
    native = spread(Gemma4ForConditionalGeneration(Gemma4Config(**values)).eval())
    want = logits(native)
    model = zoo.convert(native)
    assert [i for i, _ in moe_layers(model)] == [0, 1]
    assert type(model.model.language_model.layers[0].moe).__name__ == "SparseMoE"
    assert rel(logits(model), want) <= 1e-5
