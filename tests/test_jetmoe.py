"""JetMoE and the zoo block's output bias: the block against a naive reference (outputs and gradients), its layout
recorded, rebuilt and refused when wrong, and the tiny JetMoE (a mixture of attention heads beside the mixture of
MLPs the zoo converts) converted losslessly with a non-zero bias, its balance loss (both mixtures' routers) equal to
the family's, reloaded, exported bit for bit, and changed by the zoo's components."""
import pytest
import torch
from transformers import AutoModelForCausalLM, JetMoeForCausalLM

import zoo
from tiny import greedy as greedy_of, logits as logits_of, rel, reload_and_export_bit_for_bit
from tests.families.test_generic_families import native_model
from zoo.architectures.family import NotExportable
from zoo.components.registry import registry
from zoo.moe import SharedMLP, SparseMoE, SwiGLUExperts
from zoo.moe.block_parts import BlockBias
from zoo.moe.layout import LayoutError, build_block, check_layout, moe_layers

E, H = 4, 16
IDS = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(1))
CAL = [torch.randint(3, 100, (4, 16), generator=torch.Generator().manual_seed(2))]


def block(shared=False):
    torch.manual_seed(0)
    router = registry.get("router", "topk-softmax").obj(H, E, 2)
    moe = SparseMoE(router, SwiGLUExperts(E, H, 8), SharedMLP(H, 8) if shared else None, output_bias=BlockBias(H))
    with torch.no_grad():
        moe.output_bias.bias.normal_()
    return moe


@pytest.mark.parametrize("shared", [False, True])
def test_output_bias_matches_a_naive_reference(shared):
    moe = block(shared)
    x = torch.randn(12, H, generator=torch.Generator().manual_seed(3), requires_grad=True)
    routing = moe.route(x)
    rows = [sum(routing.weights[t, s] * moe.experts.expert(e, x[t:t + 1])[0]
                for s, e in enumerate(routing.indices[t].tolist())) for t in range(12)]
    want = torch.stack(rows) + moe.output_bias.bias + (moe.shared_experts(x) if shared else 0)
    got = moe(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(got.square().sum(), [x, moe.output_bias.bias])
    wants = torch.autograd.grad(want.square().sum(), [x, moe.output_bias.bias])
    for a, b in zip(grads, wants):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_layout_round_trip_and_refusals():
    entry = block().layout()
    assert entry["output_bias"] == {"hidden_size": H}
    with torch.device("meta"):
        assert build_block(entry).layout() == entry
    check_layout([entry], 1, H)
    with pytest.raises(LayoutError, match=r"zoo_layout\[0\]\.output_bias\.hidden_size: 8, but the model's hidden_size"):
        check_layout([{**entry, "output_bias": {"hidden_size": 8}}], 1, H)
    with pytest.raises(LayoutError, match=r"zoo_layout\[0\]\.output_bias: hidden_size must be a positive integer"):
        check_layout([{**entry, "output_bias": {"hidden_size": "16"}}], 1, H)


def native():
    model = native_model("jetmoe")
    with torch.no_grad():  # the family initialises the bias to zero: make it count
        for layer in model.model.layers:
            layer.mlp.bias.normal_()
    return model


def logits(model):
    return logits_of(model, IDS)


def losses(model):
    with torch.no_grad():
        out = model(input_ids=IDS, labels=IDS, output_router_logits=True)
    return out.loss, out.aux_loss, len(out.router_logits)


def test_converts_losslessly_with_the_familys_balance_loss_reloads_and_exports(tmp_path):
    model = native()
    want, want_tokens, want_state, want_losses = logits(model), greedy_of(model, IDS, 4), dict(model.state_dict()), \
        losses(model)
    assert want_losses[2] == 2 * model.config.num_hidden_layers  # attention and MLP gatings, every layer
    model = zoo.convert(model)
    entry = model.config.zoo_layout[0]
    assert entry["router"] == "topk-softmax" and entry["output_bias"] == {"hidden_size": model.config.hidden_size}
    assert type(model.model.layers[0].self_attention.experts).__name__ == "JetMoeMoA"  # the attention stays JetMoE's
    assert rel(logits(model), want) <= 1e-5
    assert torch.equal(greedy_of(model, IDS, 4), want_tokens)
    loss, aux, count = losses(model)
    assert count == want_losses[2]
    torch.testing.assert_close(aux, want_losses[1], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(loss, want_losses[0], rtol=1e-5, atol=1e-7)

    reload_and_export_bit_for_bit(model, tmp_path, AutoModelForCausalLM, JetMoeForCausalLM, logits, want, want_state)


def test_zoo_components_change_it_and_the_export_says_why_not(tmp_path, one_thread):
    model = zoo.convert(native())
    zoo.apply(model, "prune-frequency", calibration=CAL, num_experts=3)
    assert all(moe.num_experts == 3 and moe.output_bias is not None for _, moe in moe_layers(model))
    loss, aux, count = losses(model)  # attention gatings with 4 experts, MLP routers with 3: per-layer mean
    assert count == 2 * model.config.num_hidden_layers and torch.isfinite(aux) and aux > 0
    with pytest.raises(NotExportable, match="attention mixture 4, top-2"):
        zoo.export(model, tmp_path / "pruned")
    assert not (tmp_path / "pruned").exists()
    zoo.apply(model, "expert-choice")
    zoo.apply(model, "quantize", bits=8, group_size=32)
    assert all(moe.router.name == "expert-choice" and moe.experts.name == "quantized" and moe.output_bias is not None
               for _, moe in moe_layers(model))
    out = logits(model)
    model.save_pretrained(tmp_path / "changed")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "changed").eval()
    assert rel(logits(back), out) <= 1e-5
