"""LongCat-Flash and the zoo block's identity (zero-computation) experts: the block against a token-by-token
reference (outputs and gradients), its layout recorded, rebuilt and refused when wrong, pruning that keeps the
identity experts, and the tiny LongCat-Flash converted losslessly, reloaded, exported back to its own layout and
changed by the zoo's components."""
import pytest
import torch
from transformers import AutoModelForCausalLM, LongcatFlashForCausalLM

import zoo
from tiny import greedy as greedy_of, logits as logits_of, rel
from tests.families.test_generic_families import native_model
from zoo.components.registry import registry
from zoo.moe import SparseMoE, SwiGLUExperts
from zoo.moe.layout import LayoutError, build_block, check_layout, moe_layers
from zoo.moe.surgery import keep_experts, merge_experts

E, Z, H = 4, 2, 16
IDS = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(1))
CAL = [torch.randint(3, 100, (4, 16), generator=torch.Generator().manual_seed(2))]


def router(name, k=3, **options):
    cls = registry.get("router", name).obj
    return cls(H, E + Z, k, **options)


def block(name="scored-topk", **options):
    torch.manual_seed(0)
    moe = SparseMoE(router(name, **options), SwiGLUExperts(E, H, 8), identity_experts=Z)
    with torch.no_grad():
        moe.router.weight.normal_(std=1.0)
    return moe


def naive(moe, x):
    """Token by token, slot by slot: an expert's output, the token itself for an identity expert, nothing for an
    empty slot; each weighted and summed."""
    routing = moe.route(x)
    rows = []
    for t in range(x.shape[0]):
        row = torch.zeros_like(x[t])
        for slot, e in enumerate(routing.indices[t].tolist()):
            w = routing.weights[t, slot]
            if e < E:
                row = row + w * moe.experts.expert(e, x[t:t + 1])[0]
            elif e < E + Z:
                row = row + w * x[t]
        rows.append(row)
    return torch.stack(rows), routing


@pytest.mark.parametrize("name", ["scored-topk", "expert-choice"])
def test_identity_experts_match_a_token_by_token_reference(name):
    moe = block(name)
    x = torch.randn(12, H, generator=torch.Generator().manual_seed(3), requires_grad=True)
    want, routing = naive(moe, x)
    assert ((routing.indices >= E) & (routing.indices < E + Z)).any()  # identity experts are picked
    if name == "expert-choice":
        assert (routing.indices == E + Z).any()  # and empty slots (index E + Z) occur
    got = moe(x)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    params = [x, moe.router.weight, moe.experts.gate_up_proj, moe.experts.down_proj]
    grad_want = torch.autograd.grad(want.square().sum(), params)
    grad_got = torch.autograd.grad(got.square().sum(), params)
    for a, b in zip(grad_got, grad_want):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_layout_round_trip_and_refusals():
    moe = block()
    entry = moe.layout()
    assert entry["identity_experts"] == Z and entry["num_experts"] == E and moe.num_experts == E
    again = build_block(entry)
    again.load_state_dict(moe.state_dict())
    assert again.layout() == entry and again.identity_experts == Z
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(4))
    assert torch.equal(again(x), moe(x))
    check_layout([entry], 1, H)
    for bad, field in (({"identity_experts": -1}, "identity_experts"), ({"identity_experts": "2"}, "identity_experts"),
                       ({"identity_experts": True}, "identity_experts"),
                       ({"num_experts_per_tok": E + Z + 1}, "num_experts_per_tok")):
        with pytest.raises(LayoutError, match=rf"zoo_layout\[0\]\.{field}"):
            check_layout([{**entry, **bad}], 1, H)
    with pytest.raises(LayoutError, match=r"identity_experts: identity experts cannot sit behind an expert map"):
        check_layout([{**entry, "expert_map": [0, 1, 2, 3]}], 1, H)
    with pytest.raises(ValueError, match=r"router has 4 experts but experts has 4 and 2 identity experts \(needs 6"):
        SparseMoE(registry.get("router", "scored-topk").obj(H, E, 2), SwiGLUExperts(E, H, 8), identity_experts=Z)


def test_pruning_keeps_the_identity_experts_and_merging_refuses_them():
    moe = block()
    pruned = keep_experts(moe, [0, 2])
    assert pruned.num_experts == 2 and pruned.identity_experts == Z and pruned.router.num_experts == 2 + Z
    assert torch.equal(pruned.router.weight, moe.router.weight[[0, 2, 4, 5]])
    # a token routed only among kept and identity experts computes as before
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(5))
    before, after = moe(x), pruned(x)
    untouched = ~torch.isin(moe.route(x).indices, torch.tensor([1, 3])).any(-1)
    assert untouched.any() and torch.allclose(after[untouched], before[untouched], rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match=r"keep must name experts in \[0, 4\)"):
        keep_experts(moe, [0, E])  # an identity expert is not an expert to keep
    with pytest.raises(ValueError, match="identity experts .* merging does not support them"):
        merge_experts(moe, [[0, 1], [2, 3]], [[1, 1], [1, 1]])


# ---- the family ---------------------------------------------------------------------------------------------------
def native():
    """The tiny LongCat-Flash (experts 32 wide), its router spread so identity experts are picked and its selection
    bias away from zero, so every part of the routing counts."""
    model = native_model("longcat_flash")
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.router.classifier.weight.normal_(generator=gen)
            layer.mlp.router.e_score_correction_bias.copy_(torch.rand(E + Z, generator=gen) * 0.2)
    return model


def logits(model, ids=IDS):
    return logits_of(model, ids)


def greedy(model):
    return greedy_of(model, IDS, 4)


def identity_picks(model):
    picks = []
    hooks = [moe.router.register_forward_hook(lambda m, a, out: picks.append(
        ((out.indices >= moe.num_experts) & (out.indices < moe.num_experts + Z)).sum().item()))
        for _, moe in moe_layers(model)]
    logits(model)
    for h in hooks:
        h.remove()
    return sum(picks)


def test_converts_losslessly_reloads_and_exports_its_own_layout(tmp_path):
    model = native()
    want, want_tokens, want_state = logits(model), greedy(model), dict(model.state_dict())
    model = zoo.convert(model)
    assert [moe.identity_experts for _, moe in moe_layers(model)] == [Z, Z]
    entry = model.config.zoo_layout[0]
    assert entry["router"] == "scored-topk" and entry["router_options"]["selection_bias"]
    assert not entry["router_options"]["norm_topk_prob"] and entry["router_options"]["routed_scaling_factor"] == 6.0
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == E  # the identity experts' rows dropped
    assert identity_picks(model) > 0
    assert rel(logits(model), want) <= 1e-5
    assert torch.equal(greedy(model), want_tokens)

    model.save_pretrained(tmp_path / "zoo")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "zoo").eval()
    assert type(back) is type(model) and back.config.zoo_layout == model.config.zoo_layout
    assert rel(logits(back), want) <= 1e-5

    zoo.export(back, tmp_path / "native")
    again = LongcatFlashForCausalLM.from_pretrained(tmp_path / "native").eval()
    assert type(again) is LongcatFlashForCausalLM
    state = again.state_dict()
    for key, value in want_state.items():
        if key.endswith("experts.gate_up_proj"):  # the identity experts' rows come back as zeros
            assert torch.equal(state[key][:E], value[:E]) and not state[key][E:].any()
        else:
            assert torch.equal(state[key], value), key
    assert rel(logits(again), want) <= 1e-5


def test_zoo_components_change_it_and_it_reloads(tmp_path, one_thread):
    model = zoo.convert(native())
    zoo.apply(model, "prune-frequency", calibration=CAL, num_experts=3)
    assert all(moe.num_experts == 3 and moe.identity_experts == Z for _, moe in moe_layers(model))
    pruned = logits(model)
    zoo.export(model, tmp_path / "pruned")  # the native layout holds fewer FFN experts beside the identity ones
    again = LongcatFlashForCausalLM.from_pretrained(tmp_path / "pruned").eval()
    assert (again.config.n_routed_experts, again.config.zero_expert_num) == (3, Z)
    assert rel(logits(again), pruned) <= 1e-5

    zoo.apply(model, "expert-choice")  # experts pick tokens: identity rows pick theirs too
    assert identity_picks(model) > 0
    zoo.apply(model, "quantize", bits=8, group_size=32)
    assert all(moe.router.name == "expert-choice" and moe.experts.name == "quantized" and moe.identity_experts == Z
               for _, moe in moe_layers(model))
    out = logits(model)
    assert torch.isfinite(out).all()
    model.save_pretrained(tmp_path / "changed")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "changed").eval()
    assert [s["name"] for s in back.config.zoo_recipe] == ["prune-frequency", "expert-choice", "quantize"]
    assert rel(logits(back), out) <= 1e-5


def test_merging_is_refused_before_the_model_changes():
    model = zoo.convert(native())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="identity experts"):
        zoo.apply(model, "hc-smoe", calibration=CAL, num_experts=2)
    state = model.state_dict()
    assert state.keys() == before.keys() and all(torch.equal(state[k], v) for k, v in before.items())
