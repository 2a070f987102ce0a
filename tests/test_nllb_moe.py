"""NLLB-MoE's pieces in the zoo: its top-2 router with batch-wide expert capacity (``top2-capacity``) routes exactly
as the family's router does at inference, and ``mlp`` experts with biases (the family's fc1/fc2) match their
reference. The family itself is not converted: transformers 5.24's NLLB-MoE experts run only experts 0 and 1 (see
the last test), so no zoo model of it can match both the native logits and the routing it was trained with."""
import itertools

import pytest
import torch
from transformers import NllbMoeConfig, NllbMoeForConditionalGeneration
from transformers.models.nllb_moe.modeling_nllb_moe import NllbMoeTop2Router

import zoo
from zoo.moe import Routing, RoutingContext, routing_context
from zoo.moe.experts import MLPExperts
from zoo.moe.layout import moe_layers
from zoo.testing import check_reference, tiny_model
from zoo_routers.top2_capacity import Top2Capacity

pytestmark = pytest.mark.usefixtures("one_thread")

H, E, B, S = 16, 4, 2, 12
HIDDEN = torch.randn(B * S, H, generator=torch.Generator().manual_seed(0))
ATTENTION = torch.ones(B, S, dtype=torch.long)
ATTENTION[1, 9:] = 0  # three padding tokens at the end of the second sequence


def eager_mask(attention):
    """The 4D additive mask transformers' eager attention builds (and hands to NLLB-MoE's router)."""
    mask = (1 - attention)[:, None, None, :].float() * torch.finfo(torch.float32).min
    return mask.expand(B, 1, S, S)


def dense(routing: Routing) -> torch.Tensor:
    """``[T, E]`` weights per expert (empty slots dropped): the native router's combine weights."""
    return torch.zeros(B * S, E + 1).scatter_add(1, routing.indices, routing.weights)[:, :E]


@pytest.mark.parametrize("fraction,normalize_first,prioritized,padding",
                         list(itertools.product([1.0, 0.25, 0.0], [False, True], [False, True], [False, True])))
def test_routes_as_nllb_moe_at_inference(fraction, normalize_first, prioritized, padding):
    config = NllbMoeConfig(d_model=H, num_experts=E, expert_capacity=3, moe_eval_capacity_token_fraction=fraction,
                           normalize_router_prob_before_dropping=normalize_first,
                           batch_prioritized_routing=prioritized)
    torch.manual_seed(1)
    native = NllbMoeTop2Router(config).eval()
    router = Top2Capacity(H, E, expert_capacity=3, eval_capacity_fraction=fraction,
                          normalize_before_dropping=normalize_first, batch_prioritized=prioritized).eval()
    router.weight.data.copy_(native.classifier.weight)
    with torch.no_grad():
        _, want, want_logits = native(HIDDEN, eager_mask(ATTENTION) if padding else None)
        with routing_context(RoutingContext(attention_mask=ATTENTION if padding else None)):
            got = router(HIDDEN)
    assert torch.equal(got.logits, want_logits)
    torch.testing.assert_close(dense(got), want, rtol=0, atol=1e-7)
    kept = (got.indices < E).sum().item()
    if fraction == 1.0:  # capacity = all the tokens: only padding loses its experts
        assert kept == 2 * (B * S - (3 if padding else 0))
    else:
        assert kept < 2 * (B * S - 3)  # the capacity drops choices on these inputs


def test_token_dropout_scales_the_weights_at_inference():
    router = Top2Capacity(H, E, token_dropout=0.2).eval()
    plain = Top2Capacity(H, E).eval()
    plain.weight.data.copy_(router.weight)
    with torch.no_grad():
        torch.testing.assert_close(router(HIDDEN).weights, plain(HIDDEN).weights * 0.8)


@pytest.mark.parametrize("options,message", [({"top_k": 1}, "top_k must be 2"),
                                             ({"expert_capacity": 0}, "expert_capacity"),
                                             ({"token_dropout": 1.0}, "token_dropout"),
                                             ({"batch_prioritized": 1}, "batch_prioritized")])
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        Top2Capacity(H, E, **options)


def test_router_applies_and_reloads_through_the_zoo(tmp_path):
    model = zoo.convert(tiny_model("mixtral"))
    zoo.apply(model, "top2-capacity", eval_capacity_fraction=0.5, batch_prioritized=True)
    assert {moe.router.name for _, moe in moe_layers(model)} == {"top2-capacity"}
    ids = torch.randint(3, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids).logits
    model.save_pretrained(tmp_path)
    back = zoo.load(str(tmp_path)).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, out, rtol=1e-5, atol=1e-6)


def test_mlp_experts_with_biases_match_the_reference_and_quantize_refuses_them():
    torch.manual_seed(0)
    experts = MLPExperts(E, H, 32, activation="relu", bias=True)
    assert experts.options()["bias"] is True and "bias" not in MLPExperts(E, H, 32).options()
    with torch.no_grad():
        experts.up_proj_bias.normal_()
        experts.down_proj_bias.normal_()
    check_reference(experts)
    x = torch.randn(3, H)
    routing = Routing(torch.rand(3, 2), torch.tensor([[0, 2], [3, E], [1, 0]]))
    want = torch.stack([sum(routing.weights[t, s] * (experts.down_proj[e] @ torch.relu(
        experts.up_proj[e] @ x[t] + experts.up_proj_bias[e]) + experts.down_proj_bias[e])
        for s, e in enumerate(routing.indices[t].tolist()) if e < E) for t in range(3)])
    torch.testing.assert_close(experts(x, routing), want, rtol=1e-5, atol=1e-6)
    with pytest.MonkeyPatch.context() as patch:  # the gather path a compiled decode step takes (T * k <= E)
        patch.setattr(torch.compiler, "is_compiling", lambda: True)
        torch.testing.assert_close(experts(x[:2], Routing(routing.weights[:2], routing.indices[:2])), want[:2],
                                   rtol=1e-5, atol=1e-6)

    model = zoo.convert(tiny_model("mixtral"))
    for _, moe in moe_layers(model):
        moe.experts = MLPExperts(moe.experts.num_experts, moe.experts.hidden_size, moe.experts.intermediate_size,
                                 activation="relu", bias=True)
    with pytest.raises(ValueError, match="with biases; quantize keeps no expert biases"):
        zoo.apply(model, "quantize", bits=8, group_size=32)


def test_transformers_nllb_moe_experts_run_only_experts_zero_and_one():
    """What blocks the family: NllbMoeExperts one-hot encodes the router's 0/1 first-choice mask as if it held
    expert ids, so expert 1 computes every token's first choice and expert 0 all the rest. While this holds, a
    lossless conversion would have to copy the defect; the family stays excepted."""
    config = NllbMoeConfig(vocab_size=64, d_model=H, encoder_ffn_dim=32, decoder_ffn_dim=32, encoder_layers=1,
                           decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2, num_experts=E,
                           encoder_sparse_step=1, decoder_sparse_step=1, max_position_embeddings=32,
                           moe_token_dropout=0.0)
    torch.manual_seed(0)
    moe = NllbMoeForConditionalGeneration(config).eval().model.encoder.layers[0].ffn
    x = HIDDEN[None]
    with torch.no_grad():
        first, weights, _ = moe.router(HIDDEN)
        got = moe(x)[0]
        experts = [moe.experts[f"expert_{e}"](HIDDEN) for e in range(E)]
        intended = sum(weights[:, e, None] * experts[e] for e in range(E))
        as_run = (weights * first).sum(1, keepdim=True) * experts[1] + \
            (weights * (1 - first)).sum(1, keepdim=True) * experts[0]
    torch.testing.assert_close(got, as_run, rtol=1e-5, atol=1e-6)
    assert (got - intended).abs().max() > 1e-3
