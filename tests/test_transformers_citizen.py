"""The zoo classes behave as their native parents: tuple outputs, a base model and task heads built from
zoo_layout (Auto classes included), SparseMoE blocks from a fresh config, the family's own aux loss, fp32
routers where native keeps them, no experts_implementation silently ignored, native's deprecations."""
import warnings

import pytest
import torch
from transformers import (AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification,
                          AutoModelForTokenClassification, DynamicCache)

import zoo
from zoo.architectures.factory import zoo_classes
from zoo.moe import SparseMoE
from zoo.components.registry import registry
from tiny import FAMILIES, tiny_config, tiny_native

pytestmark = pytest.mark.usefixtures("one_thread")
IDS = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))


def classes(family):
    return zoo_classes(registry.get("architecture", family).obj)


@pytest.mark.parametrize("family", FAMILIES)
def test_return_dict_false_gives_the_tuple_native_gives(family):
    native, model = tiny_native(family), zoo.convert(tiny_native(family))
    as_tuple, native_tuple = model(IDS, return_dict=False), native(IDS, return_dict=False)
    assert isinstance(as_tuple, tuple) and len(as_tuple) == len(native_tuple)
    torch.testing.assert_close(as_tuple[0], model(IDS).logits)
    model.config.return_dict = False  # (native 5.24 crashes here: its LM reads the tuple its base model returns)
    assert isinstance(model(IDS), tuple)


@pytest.mark.parametrize("family", FAMILIES)
def test_aux_loss_is_the_family_definition(family):
    native, model = tiny_native(family), zoo.convert(tiny_native(family))
    mask = torch.ones_like(IDS)
    mask[0, :3] = 0
    a = native(IDS, attention_mask=mask, labels=IDS, output_router_logits=True)
    b = model(IDS, attention_mask=mask, labels=IDS, output_router_logits=True)
    if a.aux_loss is None:  # DeepSeek-V3 trains without one (bias balancing)
        assert b.aux_loss is None
        return
    torch.testing.assert_close(b.aux_loss, a.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-6)


def test_aux_loss_with_layers_that_differ_is_the_per_layer_mean():
    from zoo.moe.losses import load_balancing_loss

    from zoo.moe.surgery import keep_experts

    model = zoo.convert(tiny_native("mixtral"))
    model.model.layers[1].mlp = keep_experts(model.model.layers[1].mlp, [0, 1, 2])  # 4 and 3 experts
    out = model(IDS, output_router_logits=True)
    blocks = [m for _, m in zoo.moe.layout.moe_layers(model)]
    expected = torch.stack([m.top_k * load_balancing_loss(lg, m.top_k) for lg, m in zip(out.router_logits, blocks)])
    torch.testing.assert_close(out.aux_loss, expected.mean())


@pytest.mark.parametrize("family", FAMILIES)
def test_base_model_is_the_lm_backbone(family, tmp_path):
    model = zoo.convert(tiny_native(family))
    model.save_pretrained(tmp_path)
    base = AutoModel.from_pretrained(tmp_path)
    assert type(base).__name__ == f"Zoo{type(model.model).__name__.removeprefix('Zoo')}"
    assert sum(isinstance(layer.mlp, SparseMoE) for layer in base.layers) == len(zoo.moe.layout.moe_layers(model))
    with torch.no_grad():
        torch.testing.assert_close(base(IDS).last_hidden_state, model.model(IDS).last_hidden_state)
        assert len(base(IDS, output_router_logits=True).router_logits) == len(zoo.moe.layout.moe_layers(model))


@pytest.mark.parametrize("family", FAMILIES)
def test_fresh_config_builds_zoo_blocks_equal_to_native(family):
    cfg_cls, base_cls, lm_cls = classes(family)
    torch.manual_seed(3)
    native = registry.get("architecture", family).obj.model_class(tiny_config(family))
    torch.manual_seed(3)
    model = lm_cls(cfg_cls(**tiny_config(family).to_dict()))
    assert any(isinstance(layer.mlp, SparseMoE) for layer in model.model.layers)
    assert any(isinstance(layer.mlp, SparseMoE) for layer in base_cls(cfg_cls(**tiny_config(family).to_dict())).layers)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, native(IDS).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "gpt_oss"])
def test_task_heads_run_on_the_zoo_backbone(family, tmp_path):
    zoo.convert(tiny_native(family)).save_pretrained(tmp_path)
    for auto in (AutoModelForSequenceClassification, AutoModelForTokenClassification):
        head = auto.from_pretrained(tmp_path, num_labels=3)
        assert type(head).__name__.startswith("Zoo")
        assert any(isinstance(layer.mlp, SparseMoE) for layer in head.model.layers)
        assert head(IDS).logits.shape[-1] == 3


def test_a_head_the_family_lacks_is_a_clear_error(tmp_path):
    zoo.convert(tiny_native("olmoe")).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="Unrecognized configuration class .*ZooOlmoeConfig"):
        AutoModelForSequenceClassification.from_pretrained(tmp_path)


def test_router_stays_fp32_where_native_keeps_it():
    cfg_cls, _, _ = classes("deepseek_v3")
    native = AutoModelForCausalLM.from_config(tiny_config("deepseek_v3"), dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_config(cfg_cls(**tiny_config("deepseek_v3").to_dict()), dtype=torch.bfloat16)
    assert native.model.layers[1].mlp.gate.weight.dtype == torch.float32
    router = model.model.layers[1].mlp.router
    assert router.weight.dtype == torch.float32 and router.e_score_correction_bias.dtype == torch.float32
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16


@pytest.mark.parametrize("impl", ["sonicmoe", "deepgemm"])
def test_an_experts_implementation_the_zoo_cannot_honour_is_an_error(impl, tmp_path):
    cfg_cls, _, _ = classes("mixtral")
    with pytest.raises(ValueError, match=f"experts_implementation='{impl}' cannot be honoured"):
        AutoModelForCausalLM.from_config(cfg_cls(**tiny_config("mixtral").to_dict()), experts_implementation=impl)
    zoo.convert(tiny_native("mixtral")).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="cannot be honoured"):
        AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation=impl)
    AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="eager")


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_transformers_experts_functions_run_the_plain_experts_and_only_those(impl, tmp_path):
    """grouped_mm / batched_mm run by transformers' own functions on plain SwiGLU experts (outputs and gradients
    as the zoo's dispatch gives them), through from_pretrained, set_experts_implementation and later compressions;
    a quantized layer keeps the zoo's dispatch; empty slots (expert-choice) cost nothing and change nothing."""
    from unittest.mock import Mock, patch

    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from zoo.moe.layout import moe_layers
    from zoo.moe.quantized import QuantizedExperts

    zoo.convert(tiny_native("gpt_oss")).save_pretrained(tmp_path)  # biased, clamped SwiGLU experts
    eager = AutoModelForCausalLM.from_pretrained(tmp_path).train()
    model = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation=impl).train()
    assert model.config._experts_implementation == impl
    assert {moe.experts_implementation for _, moe in moe_layers(model)} == {impl}
    assert {moe.experts_implementation for _, moe in moe_layers(eager)} == {"eager"}
    mock = Mock(wraps=ALL_EXPERTS_FUNCTIONS[impl])
    with patch.dict("transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS._global_mapping", {impl: mock}):
        got = model(IDS).logits
        assert mock.call_count == len(moe_layers(model))
    want = eager(IDS).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.square().sum().backward()
    want.square().sum().backward()
    for (name, a), (_, b) in zip(model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")

    model.eval()
    (_, first), (_, second) = moe_layers(model)
    first.experts = QuantizedExperts.from_dense(first.experts, bits=8, group_size=32)
    mock.reset_mock()
    with patch.dict("transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS._global_mapping", {impl: mock}), \
            torch.no_grad():
        model(IDS)
        assert mock.call_count == 1  # the plain layer only
    zoo.apply(model, "expert-choice")  # with_parts: the blocks keep the implementation; empty slots appear
    assert {moe.experts_implementation for _, moe in moe_layers(model)} == {impl}
    with torch.no_grad():
        out = model(IDS).logits
        model.set_experts_implementation("eager")
        assert {moe.experts_implementation for _, moe in moe_layers(model)} == {"eager"}
        torch.testing.assert_close(out, model(IDS).logits, rtol=1e-5, atol=1e-5)


def test_legacy_past_key_values_warns_as_native():
    model = zoo.convert(tiny_native("mixtral"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(IDS[:, :4], past_key_values=DynamicCache(config=model.config), use_cache=True)
    assert any("past_key_values" in str(w.message) and "deprecated" in str(w.message) for w in caught)


def test_forward_is_annotated_for_transformers_introspection():
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast
    import inspect

    _, _, lm_cls = classes("mixtral")
    assert inspect.signature(lm_cls.forward).return_annotation in (MoeCausalLMOutputWithPast,
                                                                   "MoeCausalLMOutputWithPast")
