"""zoo.apply: lookup with suggestions, validation before touching the model, the recipe, router swaps."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import zoo
from zoo.moe.layout import moe_layers
from tiny import padded_batch, tiny_native

IDS, MASK = padded_batch()


def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_unknown_name_suggests_close_matches():
    model = zoo.convert(tiny_native("mixtral"))
    with pytest.raises(KeyError, match="did you mean 'topk-softmax'"):
        zoo.apply(model, "topk-sofmax")


@pytest.mark.parametrize("options, message", [
    ({"norm_topk_prb": True}, "did you mean 'norm_topk_prob'"),
    ({"top_k": 9}, "top_k must be an integer in"),
    ({"top_k": 0}, "top_k must be an integer in"),
])
def test_rejected_options_leave_the_model_bit_identical(options, message):
    model = zoo.convert(tiny_native("mixtral"))
    before, recipe, layout = snapshot(model), list(model.config.zoo_recipe), model.config.zoo_layout
    routers = [m.router for _, m in moe_layers(model)]
    with pytest.raises(ValueError, match=message):
        zoo.apply(model, "topk-softmax", **options)
    assert same(before, model.state_dict())
    assert [m.router for _, m in moe_layers(model)] == routers
    assert model.config.zoo_recipe == recipe and model.config.zoo_layout == layout


def test_invalid_value_in_a_later_layer_changes_nothing():
    """sigmoid-bias with n_group=3 fails on every layer's 4 experts: no layer may be half-swapped."""
    model = zoo.convert(tiny_native("mixtral"))
    before = snapshot(model)
    with pytest.raises(ValueError, match="divisible by n_group"):
        zoo.apply(model, "sigmoid-bias", n_group=3)
    assert same(before, model.state_dict())


def test_topk_softmax_top1_swaps_every_router_and_keeps_the_gate(tmp_path):
    model = zoo.convert(tiny_native("qwen3_moe"))
    gates = [m.router.weight.clone() for _, m in moe_layers(model)]
    ref = model(input_ids=IDS, attention_mask=MASK).logits
    zoo.apply(model, "topk-softmax", top_k=1)
    blocks = [m for _, m in moe_layers(model)]
    assert all(b.top_k == 1 for b in blocks)
    assert all(torch.equal(b.router.weight, g) for b, g in zip(blocks, gates))
    assert all(b.router.norm_topk_prob for b in blocks)  # carried over from the family's router
    out = model(input_ids=IDS, attention_mask=MASK).logits
    assert not torch.allclose(out, ref)  # one expert instead of two changes the function

    # top-1 with renormalisation == the single most probable expert with weight 1
    x = torch.randn(5, blocks[0].router.hidden_size)
    r = blocks[0].router(x)
    assert torch.equal(r.indices[:, 0], r.logits.argmax(-1)) and torch.allclose(r.weights, torch.ones(5, 1))

    step = model.config.zoo_recipe[-1]
    assert step == {"name": "topk-softmax", "kind": "router", "options": {"top_k": 1}, "calibration": None,
                    "distribution": "moe-zoo", "version": zoo.components.plugins.provenance("router", "topk-softmax")["version"]}
    model.save_pretrained(tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert loaded.config.zoo_recipe == model.config.zoo_recipe
    assert [m.top_k for _, m in moe_layers(loaded)] == [1, 1]
    with torch.no_grad():
        assert (loaded(input_ids=IDS, attention_mask=MASK).logits - out).abs().max() < 1e-6


def test_apply_converts_a_native_model_first():
    model = tiny_native("olmoe")
    zoo.apply(model, "topk-softmax", top_k=1)
    assert type(model).__name__ == "ZooOlmoeForCausalLM"
    assert [m.top_k for _, m in moe_layers(model)] == [1, 1]


def test_calibration_is_recorded():
    model = zoo.convert(tiny_native("mixtral"))
    zoo.apply(model, "topk-softmax", calibration=["some text", "more text"], top_k=1)
    cal = model.config.zoo_recipe[-1]["calibration"]
    assert cal["type"] == "texts" and cal["count"] == 2 and len(cal["sha256"]) == 16


def test_router_logits_recorded_after_swap_even_if_hooks_were_installed():
    model = zoo.convert(tiny_native("mixtral"))
    model(input_ids=IDS, attention_mask=MASK, output_router_logits=True)  # installs the recorders
    zoo.apply(model, "topk-softmax", top_k=1)
    out = model(input_ids=IDS, attention_mask=MASK, output_router_logits=True)
    assert len(out.router_logits) == 2


def test_list_components_kinds():
    names = {c["name"] for c in zoo.list_components("router")}
    assert {"topk-softmax", "sigmoid-bias"} <= names
    assert all(c["kind"] != "model" for c in zoo.list_components())
    with pytest.raises(KeyError, match="did you mean 'router'"):
        zoo.list_components("routr")
