"""Zaya and the router state a block hands the next: ``zaya-mlp`` against Zaya's own router (state, skip class,
selection bias), the block's ``(hidden, state) -> (out, state)`` call against a token-by-token reference, its layout,
pruning that keeps the skip class, the tiny Zaya converted losslessly, reloaded and exported bit for bit, the
layer-at-a-time engine routing calibration tokens with the state the model hands them, and the zoo's components."""
import pytest
import torch
from transformers import AutoModelForCausalLM, ZayaForCausalLM
from transformers.models.zaya.modeling_zaya import ZayaRouter

import zoo
from tiny import greedy as greedy_of, logits as logits_of, rel, reload_and_export_bit_for_bit
from tests.families.test_generic_families import native_model
from tests.families.tiny_configs import tiny_config
from zoo.architectures.zaya import Zaya
from zoo.components.registry import registry
from zoo.editing.layerwise import capture_inputs
from zoo.editing.stats import collect, layer_stats
from zoo.moe import SparseMoE, SwiGLUExperts, routing_context
from zoo.moe.layout import LayoutError, build_block, check_layout, decoder_layers, moe_layers
from zoo.moe.surgery import keep_experts
from zoo.testing.reference import check_reference

E, H, R = 4, 16, 8
IDS = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(1))
CAL = [torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(2)),
       torch.randint(3, 100, (1, 9), generator=torch.Generator().manual_seed(4))]
ZayaMLP = registry.get("router", "zaya-mlp").obj


def spread(gate, gen):
    """Zaya's router with real spread: random weights and expert biases below the skip class's -1 at times, so the
    skip class, the state and the selection bias all count."""
    with torch.no_grad():
        for p in gate.parameters():
            p.normal_(generator=gen)
        gate.balancing_biases.copy_(torch.cat([-0.5 - 1.5 * torch.rand(gate.num_experts, generator=gen),
                                               torch.tensor([-1.0])]))  # transformers' load resets it to -1


def routers(layer: int, k: int = 1):
    """Zaya's own router of ``layer`` and the zaya-mlp (top-``k``) holding its tensors."""
    config = tiny_config("zaya")
    config.hidden_size, config.router_hidden_size = H, R
    native = ZayaRouter(config, layer)
    spread(native, torch.Generator().manual_seed(layer))
    ours = ZayaMLP(H, E, k, router_hidden_size=R, reads_state=native.use_eda)
    state = Zaya().to_zoo_state({f"gate.{name}": v for name, v in native.state_dict().items()})
    ours.load_state_dict({name.removeprefix("router."): v for name, v in state.items()})
    return native, ours


@pytest.mark.parametrize("layer", [0, 1])
def test_the_router_is_zayas_own(layer):
    native, ours = routers(layer)
    x = torch.randn(3, 20, H, generator=torch.Generator().manual_seed(5))
    previous = torch.randn(3, 20, R, generator=torch.Generator().manual_seed(6))
    logits, weights, indices, state = native(x, router_states=previous)
    got = ours(x.view(-1, H), state=previous.view(-1, R))
    skip = got.indices == E
    assert skip.any() and (~skip).any()  # the skip class is picked, and experts are
    assert torch.equal(got.indices.masked_fill(skip, 0), indices)  # Zaya sends a skip pick to expert 0, weight 0
    assert torch.equal(got.weights, weights) and not got.weights[skip].any()
    assert torch.equal(got.logits, logits) and torch.equal(got.state, state.view(-1, R))
    without = ours(x.view(-1, H)).state  # no state handed in: Zaya adds none
    assert torch.equal(without, native(x)[3].view(-1, R))
    assert torch.equal(without, got.state) == (layer == 0)  # the first layer's router reads no state
    check_reference(ours, top_k=1, where="zaya-mlp")  # a seeded state handed in, its own state compared too


def test_the_router_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match=r"router_hidden_size \(4\) must differ from the number of experts"):
        ZayaMLP(H, E, 1, router_hidden_size=E)
    with pytest.raises(ValueError, match="router_hidden_size must be a positive integer"):
        ZayaMLP(H, E, 1, router_hidden_size=0)
    with pytest.raises(ValueError, match="either its router scores or its router state"):
        SparseMoE(ZayaMLP(H, E, 1, router_hidden_size=R), SwiGLUExperts(E, H, 8), returns_router_scores=True,
                  carries_router_state=True)


def block(k=2):
    torch.manual_seed(0)
    return SparseMoE(routers(1, k)[1], SwiGLUExperts(E, H, 8), carries_router_state=True)


def test_the_block_takes_and_hands_on_the_state():
    """``block(hidden, state) -> (out, state)`` as Zaya's decoder layer calls it: each token's picked experts weighted,
    a skip pick adding nothing, outputs and gradients as token by token."""
    moe = block()
    x = torch.randn(3, 8, H, generator=torch.Generator().manual_seed(3), requires_grad=True)
    previous = torch.randn(3, 8, R, generator=torch.Generator().manual_seed(4), requires_grad=True)
    out, state = moe(x, previous)
    routing = moe.router(x.view(-1, H), state=previous.view(-1, R))
    assert (routing.indices == E).any() and state.shape == (3, 8, R) and torch.equal(state.view(-1, R), routing.state)
    rows = []
    for t, token in enumerate(x.view(-1, H)):
        picked = [(routing.weights[t, s], e) for s, e in enumerate(routing.indices[t].tolist()) if e < E]
        rows.append(sum((w * moe.experts.expert(e, token[None])[0] for w, e in picked), torch.zeros(H)))
    want = torch.stack(rows).view(3, 8, H)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    params = [x, previous, moe.router.weight, moe.router.router_states_scale, moe.experts.gate_up_proj]
    for a, b in zip(torch.autograd.grad(out.square().sum(), params), torch.autograd.grad(want.square().sum(), params)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    plain = SparseMoE(moe.router, moe.experts)  # a block that carries no state: the router routes on its input
    torch.testing.assert_close(plain(x), moe(x, None)[0])


def test_layout_round_trip_and_refusal():
    moe = block()
    entry = moe.layout()
    assert entry["carries_router_state"] and entry["router_options"]["router_hidden_size"] == R
    again = build_block(entry)
    again.load_state_dict(moe.state_dict())
    x, previous = torch.randn(5, H), torch.randn(5, R)
    assert again.layout() == entry and all(torch.equal(a, b) for a, b in zip(again(x, previous), moe(x, previous)))
    check_layout([entry], 1, H)
    with pytest.raises(LayoutError, match=r"zoo_layout\[0\]\.router_options: router_hidden_size \(4\) must differ"):
        check_layout([{**entry, "router_options": {**entry["router_options"], "router_hidden_size": E}}], 1, H)


def test_pruning_keeps_the_skip_class():
    moe = block(k=1)
    pruned = keep_experts(moe, [1, 2])
    router = pruned.router
    assert pruned.num_experts == 2 and router.num_experts == 2 and pruned.carries_router_state
    assert torch.equal(router.weight, moe.router.weight[[1, 2]])
    assert torch.equal(router.balancing_bias, moe.router.balancing_bias[[1, 2]])
    assert torch.equal(router.skip_weight, moe.router.skip_weight)
    assert torch.equal(router.skip_bias, moe.router.skip_bias)
    x, previous = torch.randn(64, H, generator=torch.Generator().manual_seed(5)), torch.randn(64, R)
    before, after = moe.router(x, state=previous), router(x, state=previous)
    # the same function over the classes left: the kept experts' logits, then the skip class's; the same state
    assert torch.equal(after.logits, before.logits[:, [1, 2, E]]) and torch.equal(after.state, before.state)
    skip = (after.indices == 2).squeeze(-1)  # the skip class is an empty slot of the two experts left
    assert skip.any() and (~skip).any() and not after.weights[skip].any()
    assert not pruned(x, previous)[0][skip].any()


# ---- the family ---------------------------------------------------------------------------------------------------
def native():
    model = native_model("zaya")
    gen = torch.Generator().manual_seed(3)
    for layer in model.model.layers:
        spread(layer.mlp.gate, gen)
    return model


def logits(model, **kwargs):
    return logits_of(model, IDS) if not kwargs else model(input_ids=IDS, use_cache=False, **kwargs)


def skips(model) -> list[int]:
    picks = []
    hooks = [moe.router.register_forward_hook(
        lambda m, a, out: picks.append((out.indices == m.num_experts).sum().item())) for _, moe in moe_layers(model)]
    logits(model)
    for h in hooks:
        h.remove()
    return picks


def test_converts_losslessly_reloads_and_exports_bit_for_bit(tmp_path):
    model = native()
    want, want_tokens, want_state = logits(model), greedy_of(model, IDS, 4), dict(model.state_dict())
    with torch.no_grad():
        want_router = logits(model, output_router_logits=True).router_logits
        scale = model.model.layers[1].mlp.gate.router_states_scale
        kept = scale.clone()
        scale.zero_()
        assert rel(logits(model), want) > 1e-3  # the state handed from layer 0 changes layer 1's routing
        scale.copy_(kept)
    model = zoo.convert(model)
    entries = model.config.zoo_layout
    assert [e["router_options"]["reads_state"] for e in entries] == [False, True]
    assert all(e["router"] == "zaya-mlp" and e["carries_router_state"] for e in entries)
    assert sum(skips(model)) > 0
    assert rel(logits(model), want) <= 1e-5 and torch.equal(greedy_of(model, IDS, 4), want_tokens)
    with torch.no_grad():
        got_router = logits(model, output_router_logits=True).router_logits
    assert len(got_router) == 2  # (layer 1's read layer 0's output, which the expert kernel may round differently)
    for a, b in zip(got_router, want_router):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    reload_and_export_bit_for_bit(model, tmp_path, AutoModelForCausalLM, ZayaForCausalLM, logits, want, want_state)


def test_layer_at_a_time_calibration_routes_as_the_model_does(one_thread):
    """The engine hands each layer's compressor the state its calibration tokens' block was handed (the routing
    context), so statistics taken in chunks route as the model's own forward does; without it layer 1 would not."""
    model = zoo.convert(native())
    want = collect(model, CAL)
    inputs = capture_inputs(model, CAL)
    differs = []
    for (i, moe), seen in zip(moe_layers(model), want):
        layer = decoder_layers(model)[i]
        x = inputs.block_inputs(i, layer)
        with routing_context(inputs.joined_context()):
            got = layer_stats(i, moe, x, chunk=7)
        assert torch.equal(got.counts, seen.counts) and torch.allclose(got.gate_sum, seen.gate_sum)
        differs.append(not torch.equal(layer_stats(i, moe, x, chunk=7).counts, seen.counts))
        inputs = inputs.advance(i, layer)
    assert differs == [False, True]


def test_zoo_components_change_it_and_it_reloads(tmp_path, one_thread):
    model = zoo.convert(native())
    zoo.apply(model, "prune-frequency", calibration=CAL, num_experts=3)
    assert all(moe.num_experts == 3 and moe.router.skip_weight.shape == (1, 16) for _, moe in moe_layers(model))
    pruned = logits(model)
    zoo.export(model, tmp_path / "pruned")  # the native layout holds fewer experts beside the skip class
    again = ZayaForCausalLM.from_pretrained(tmp_path / "pruned").eval()
    assert again.config.num_experts == 3 and again.model.layers[1].mlp.gate.balancing_biases.shape == (4,)
    assert rel(logits(again), pruned) <= 1e-5

    zoo.apply(model, "expert-choice")  # a router that carries no state: the blocks hand on none
    zoo.apply(model, "quantize", bits=8, group_size=32)
    assert all(moe.router.name == "expert-choice" and moe.experts.name == "quantized" and moe.carries_router_state
               for _, moe in moe_layers(model))
    out = logits(model)
    assert torch.isfinite(out).all()
    model.save_pretrained(tmp_path / "changed")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "changed").eval()
    assert [s["name"] for s in back.config.zoo_recipe] == ["prune-frequency", "expert-choice", "quantize"]
    assert rel(logits(back), out) <= 1e-5


def test_budgets_shared_out_by_output_error_take_the_blocks_output(one_thread):
    """allocation="error" scores each layer's output with fewer experts: the block's output beside its state, each
    layer's calibration tokens routed with the state they were handed (the statistics pass publishes it too)."""
    model = zoo.apply(zoo.convert(native()), "prune-frequency", calibration=CAL, num_experts=3, allocation="error")
    counts = model.config.zoo_recipe[-1]["results"]["experts_per_layer"]
    assert sum(counts.values()) == 6 and all(moe.carries_router_state for _, moe in moe_layers(model))
