"""Inkling (v1) and the router that weighs a block's shared experts per token: ``inkling-topk`` against Inkling's
own router, the zoo block against Inkling's own block (outputs and gradients), the layout recorded and refused when
router and shared experts disagree, pruning and merging that keep the gate's shared rows, router swaps, and the tiny
Inkling (text, and the vision-language model's language model) converted losslessly, reloaded, exported bit for bit
and changed by the zoo's components."""
import pytest
import torch
from transformers import AutoModelForCausalLM, InklingForCausalLM, InklingForConditionalGeneration
from transformers.models.inkling.configuration_inkling import InklingTextConfig
from transformers.models.inkling.modeling_inkling import InklingMoE, InklingTopkRouter

import zoo
from tests.families.test_generic_families import native_model
from tiny import greedy as greedy_of, logits as logits_of, rel, reload_and_export_bit_for_bit
from zoo.architectures.inkling import Inkling
from zoo.components.registry import registry
from zoo.moe import SharedMLP, SparseMoE, SwiGLUExperts
from zoo.moe.layout import LayoutError, build_block, check_layout, moe_layers
from zoo.moe.surgery import keep_experts, merge_experts
from zoo.testing import check_reference

E, S, H, I, K = 6, 2, 16, 8, 2
IDS = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(1))
CAL = [torch.randint(3, 100, (4, 16), generator=torch.Generator().manual_seed(2))]
InklingTopK = registry.get("router", "inkling-topk").obj


def config(**extra):
    return InklingTextConfig(hidden_size=H, n_routed_experts=E, n_shared_experts=S, num_experts_per_tok=K,
                             moe_intermediate_size=I, route_scale=2.5, num_hidden_layers=1, **extra)


def block(seed=0):
    """A zoo block as Inkling's, its gate spread (so picks and the shared weights vary) and every tensor counting."""
    torch.manual_seed(seed)
    moe = SparseMoE(InklingTopK(H, E, K, shared_experts=S, route_scale=2.5), SwiGLUExperts(E, H, I),
                    SharedMLP(H, S * I, num_experts=S))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
        moe.router.global_scale.fill_(0.8)
        moe.router.e_score_correction_bias.normal_(0, 0.3)
    return moe


def native_block(moe):
    """Inkling's own block holding the zoo block's tensors (the family's export mapping)."""
    native = InklingMoE(config())
    native.load_state_dict(Inkling().to_native_state(moe.state_dict()))
    return native


X = torch.randn(24, H, generator=torch.Generator().manual_seed(3))


def test_router_matches_inklings_own():
    moe = block()
    native = InklingTopkRouter(config())
    native.load_state_dict({k.removeprefix("gate."): v for k, v in native_block(moe).state_dict().items()
                            if k.startswith("gate.")})
    routed_logits, weights, indices, gammas = native(X)
    got = moe.router(X)
    assert torch.equal(got.indices, indices)  # the same top-k call: the same slots
    torch.testing.assert_close(got.weights, weights, rtol=0, atol=0)
    torch.testing.assert_close(got.shared_weights, gammas, rtol=0, atol=0)
    torch.testing.assert_close(got.logits, routed_logits, rtol=0, atol=0)  # routed logits, as Inkling records them
    # the k + S weights of a token sum to route_scale * global_scale
    torch.testing.assert_close(got.weights.sum(-1) + got.shared_weights.sum(-1), torch.full((24,), 2.5 * 0.8))
    check_reference(moe.router, K)  # outputs and gradients against the token-by-token reference
    check_reference(InklingTopK(H, E, K, route_scale=3.0, bias=True), K)  # no shared experts, a gate bias


def test_block_matches_inklings_own_block_outputs_and_gradients():
    moe = block()
    native = native_block(moe)
    x = X.clone().requires_grad_()
    got, want = moe(x[None])[0], native(x[None])[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    probe = torch.randn_like(got)
    (gx,) = torch.autograd.grad((got * probe).sum(), x)
    (wx,) = torch.autograd.grad((want * probe).sum(), x)
    torch.testing.assert_close(gx, wx, rtol=1e-5, atol=1e-6)
    # the shared experts' per-token weights count: unweighted, the block computes something else
    unweighted = moe(X[None])[0] - moe.shared_experts(X, moe.router(X).shared_weights) + moe.shared_experts(X)
    assert rel(unweighted, want.detach()) > 0.05


def test_layout_round_trip_and_refusals():
    moe = block()
    entry = moe.layout()
    assert entry["router_options"] == {"bias": False, "shared_experts": S, "route_scale": 2.5}
    assert entry["shared_experts"] == {"hidden_size": H, "intermediate_size": S * I, "gated": False, "num_experts": S}
    again = build_block(entry)
    again.load_state_dict(moe.state_dict())
    assert again.layout() == entry and torch.equal(again(X[None]), moe(X[None]))
    check_layout([entry], 1, H)
    with pytest.raises(LayoutError, match=r"zoo_layout\[0\]\.shared_experts: router 'inkling-topk' weighs 2 shared "
                                          r"experts per token but the block holds 1"):
        check_layout([{**entry, "shared_experts": {**entry["shared_experts"], "num_experts": 1}}], 1, H)
    with pytest.raises(LayoutError, match=r"zoo_layout\[0\]\.shared_experts: num_experts must be a positive integer "
                                          r"dividing intermediate_size \(16\), got 3"):
        check_layout([{**entry, "shared_experts": {**entry["shared_experts"], "num_experts": 3}}], 1, H)
    with pytest.raises(ValueError, match=r"router 'inkling-topk' weighs 2 shared experts per token but the block "
                                         r"holds 0"):
        SparseMoE(InklingTopK(H, E, K, shared_experts=S), SwiGLUExperts(E, H, I))
    with pytest.raises(ValueError, match="route_scale must be a positive finite number"):
        InklingTopK(H, E, K, route_scale=0)
    with pytest.raises(ValueError, match="shared_experts must be a non-negative integer"):
        InklingTopK(H, E, K, shared_experts=-1)


def untouched(moe, x, dropped):
    return ~torch.isin(moe.route(x).indices, torch.tensor(dropped)).any(-1)


def test_pruning_and_merging_keep_the_shared_rows_of_the_gate():
    moe = block()
    pruned = keep_experts(moe, [0, 2, 3, 5])
    assert pruned.num_experts == 4 and pruned.router.shared_rows == S
    assert torch.equal(pruned.router.weight, moe.router.weight[[0, 2, 3, 5, 6, 7]])
    assert torch.equal(pruned.router.e_score_correction_bias, moe.router.e_score_correction_bias[[0, 2, 3, 5]])
    assert pruned.router.global_scale.item() == pytest.approx(0.8)
    # a token whose picks survive is routed and weighted as before, its shared experts too
    same = untouched(moe, X, [1, 4])
    assert same.any() and torch.allclose(pruned(X[None])[0][same], moe(X[None])[0][same], rtol=1e-5, atol=1e-5)

    mapped = merge_experts(moe, [[0, 1], [2], [3, 4], [5]], [[1, 1], [1], [1, 2], [1]])  # HC-SMoE's expert map
    assert torch.equal(mapped.router.weight, moe.router.weight)
    assert torch.equal(mapped.route(X).shared_weights, moe.route(X).shared_weights)

    def dominant(state, mix):  # the cut router's rows: the function sees the experts' rows alone
        assert state["weight"].shape == (E, H)
        return {k: v[[0, 2, 4, 5]] if v.dim() and v.shape[0] == E else v for k, v in state.items()}

    cut = merge_experts(moe, [[0, 1], [2], [3, 4], [5]], [[1, 1], [1], [1, 2], [1]], dominant)
    assert torch.equal(cut.router.weight, moe.router.weight[[0, 2, 4, 5, 6, 7]]) and cut.router.shared_rows == S


def test_router_swaps_carry_the_experts_rows():
    from zoo.editing.apply import new_router

    moe = block()
    swapped = new_router(0, moe, registry.get("router", "scored-topk").obj, {"score": "sigmoid"})
    assert swapped.shared_rows == 0 and torch.equal(swapped.weight, moe.router.weight[:E])
    moe.router = swapped  # shared experts without weights: at weight 1 each, one MLP of their whole width
    assert moe.route(X).shared_weights is None
    torch.testing.assert_close(moe(X[None])[0], moe.experts(X, moe.route(X)) + moe.shared_experts(X))
    back = new_router(0, moe, InklingTopK, {"shared_experts": S})
    assert torch.equal(back.weight[:E], swapped.weight) and back.weight.shape == (E + S, H)
    mixtral = zoo.convert(zoo.testing.tiny_model("mixtral"))
    with pytest.raises(ValueError, match="weighs 2 shared experts per token but the block holds 0"):
        zoo.apply(mixtral, "inkling-topk", shared_experts=2)


# ---- the family ---------------------------------------------------------------------------------------------------
def native(model_type="inkling_text"):
    """The tiny Inkling (experts 32 wide, 2 shared experts), its gate spread and its global scale and selection bias
    away from their initial values, so every part of the routing counts."""
    model = native_model(model_type)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, moe in [(n, m) for n, m in model.named_modules() if isinstance(m, InklingMoE)]:
            moe.gate.weight.normal_(generator=gen)
            moe.gate.global_scale.fill_(0.7)
            moe.gate.e_score_correction_bias.copy_(torch.rand(moe.gate.num_experts, generator=gen) * 0.2)
    return model


def logits(model):
    return logits_of(model, IDS)


@pytest.mark.parametrize("model_type, auto, native_class", [
    ("inkling_text", AutoModelForCausalLM, InklingForCausalLM),
    ("inkling_mm_model", None, InklingForConditionalGeneration)])
def test_converts_losslessly_reloads_and_exports_bit_for_bit(model_type, auto, native_class, tmp_path, one_thread):
    from transformers import AutoModelForImageTextToText

    model = native(model_type)
    want, want_tokens, want_state = logits(model), greedy_of(model, IDS, 4), dict(model.state_dict())
    model = zoo.convert(model)
    (_, moe), = moe_layers(model)
    assert moe.router.name == "inkling-topk" and moe.shared_experts.num_experts == 2
    assert rel(logits(model), want) <= 1e-5
    assert torch.equal(greedy_of(model, IDS, 4), want_tokens)
    reload_and_export_bit_for_bit(model, tmp_path, auto or AutoModelForImageTextToText, native_class, logits, want,
                                  want_state)
    # the native TP plan would split each shared expert apart: no layer is sharded (every module whole, exact)
    assert not [k for k in (*model.tp_plan, *model.ep_plan) if ".layers." in k]
    if model_type == "inkling_text":  # Inkling keeps its router's global scale in fp32 (under the zoo's name too)
        half = AutoModelForCausalLM.from_pretrained(tmp_path / "zoo", dtype=torch.bfloat16)
        (_, moe), = moe_layers(half)
        assert moe.router.global_scale.dtype == torch.float32 and moe.router.weight.dtype == torch.bfloat16


def test_a_layer_by_layer_evaluation_puts_inklings_head_on_the_last_layer():
    """``zoo.editing.head``: Inkling divides the normed hidden states by its muP width multiplier and drops the
    head's rows past ``unpadded_vocab_size``."""
    from zoo.editing.head import head_logits

    model = native()
    model.config.unpadded_vocab_size = 120
    want = logits(model)
    model = zoo.convert(model)
    seen = {}
    hook = model.model.layers[-1].register_forward_hook(lambda module, args, out: seen.update(h=out))
    got = logits(model)
    hook.remove()
    assert got.shape[-1] == 120 and rel(got, want) <= 1e-5
    with torch.no_grad():
        assert rel(head_logits(model, seen["h"]).float(), got) <= 1e-6


def test_zoo_components_change_it_and_it_reloads(tmp_path, one_thread):
    model = zoo.convert(native())
    zoo.apply(model, "prune-frequency", calibration=CAL, num_experts=3)
    (_, moe), = moe_layers(model)
    assert moe.num_experts == 3 and moe.router.weight.shape[0] == 3 + 2
    pruned = logits(model)
    zoo.export(model, tmp_path / "pruned")  # the native layout holds fewer routed experts beside the shared ones
    again = InklingForCausalLM.from_pretrained(tmp_path / "pruned").eval()
    assert (again.config.n_routed_experts, again.config.n_shared_experts) == (3, 2)
    assert rel(logits(again), pruned) <= 1e-5

    zoo.apply(model, "inkling-topk", top_k=1, route_scale=4.0)  # the family's rule, changed: its gate carries over
    (_, moe), = moe_layers(model)
    assert moe.router.shared_rows == 2 and moe.top_k == 1
    zoo.apply(model, "hc-smoe", calibration=CAL, num_experts=2, router="cut")  # merged: the shared rows stay
    zoo.apply(model, "quantize", bits=8, group_size=32)
    (_, moe), = moe_layers(model)
    assert moe.router.weight.shape[0] == 2 + 2 and moe.experts.name == "quantized"
    out = logits(model)
    assert torch.isfinite(out).all()
    model.save_pretrained(tmp_path / "changed")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "changed").eval()
    assert [s["name"] for s in back.config.zoo_recipe] == ["prune-frequency", "inkling-topk", "hc-smoe", "quantize"]
    assert rel(logits(back), out) <= 1e-5
