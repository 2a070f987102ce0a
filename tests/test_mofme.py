"""MoFME (arXiv:2312.16610): the ``mofme`` experts kind (one shared SwiGLU FFN, a FiLM scale and shift per expert)
and the ``uncertainty-aware`` router (Monte Carlo dropout over the gate, calibrated mean weights), each against an
explicit reference; ``upcycle`` with ``experts="mofme"`` (the dense function at init, honest sizes, save/reload,
training)."""
import pytest
import torch
import torch.nn.functional as F
from tiny import COMMON, padded_batch, reload_max_diff
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

import zoo
from zoo.moe.layout import moe_layers
from zoo.moe import Routing
from zoo.testing import check_reference
from zoo_adapters.mofme import MofmeExperts
from zoo_routers.topk_softmax import TopKSoftmax
from zoo_routers.uncertainty_aware import UncertaintyAware

IDS, MASK = padded_batch()
pytestmark = pytest.mark.usefixtures("one_thread")
E, H, I = 6, 16, 24


def tiny_dense(seed=0):
    torch.manual_seed(seed)
    return MistralForCausalLM(MistralConfig(**COMMON, intermediate_size=96, num_hidden_layers=2, head_dim=16)).eval()


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS, attention_mask=MASK).logits


def random_experts(film="hidden", seed=0):
    torch.manual_seed(seed)
    ex = MofmeExperts(E, H, I, film=film)
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0.5 if p is ex.film_gamma else 0.0, 0.3)  # FiLM away from identity: the experts differ
    return ex


def explicit(ex, x, routing):
    """Expert e written out from the definition: down(gamma_e * silu(gate x) * (up x) + beta_e) (hidden FiLM) or
    gamma_e * down(silu(gate x) * (up x)) + beta_e (output FiLM), summed over each token's slots with its weights."""
    gate_w, up_w = ex.gate_up_proj[:I], ex.gate_up_proj[I:]
    rows = []
    for t in range(x.shape[0]):
        h = F.silu(gate_w @ x[t]) * (up_w @ x[t])
        row = torch.zeros(H)
        for slot in range(routing.indices.shape[1]):
            e = int(routing.indices[t, slot])
            if e == E:
                continue  # empty slot
            if ex.film == "hidden":
                y = ex.down_proj @ (ex.film_gamma[e] * h + ex.film_beta[e])
            else:
                y = ex.film_gamma[e] * (ex.down_proj @ h) + ex.film_beta[e]
            row = row + routing.weights[t, slot] * y
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("film", ["hidden", "output"])
def test_experts_match_the_explicit_per_expert_film_outputs_and_gradients(film):
    ex = random_experts(film)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, H, generator=g, requires_grad=True)
    indices = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(9)])
    indices[2, 1] = E  # an empty slot, whose weight (even NaN) is ignored
    raw = torch.rand(9, 3, generator=g)
    weights = raw.clone().requires_grad_()
    nan_weights = torch.where(indices == E, float("nan"), weights)
    fast = ex(x, Routing(weights=nan_weights, indices=indices))
    ref = explicit(ex, x, Routing(weights=weights, indices=indices))
    assert torch.isfinite(fast).all()
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-6)
    direction = torch.randn(fast.shape, generator=g)
    leaves = [x, weights, *ex.parameters()]
    got = torch.autograd.grad((fast * direction).sum(), leaves, allow_unused=True)
    want = torch.autograd.grad((ref * direction).sum(), leaves, allow_unused=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.zeros_like(b) if a is None else a, b, rtol=1e-4, atol=1e-6)
    check_reference(ex, top_k=3)  # and the kind's own declared reference (naive_experts over expert(e, x))


def test_sizes_are_one_ffn_plus_two_film_vectors_per_expert():
    for film, width in (("hidden", I), ("output", H)):
        ex = MofmeExperts(E, H, I, film=film)
        assert ex.num_parameters() == 3 * I * H + 2 * E * width
        assert ex.active_parameters(2) == 3 * I * H + 2 * 2 * width
        assert ex.nbytes() == 4 * ex.num_parameters()
        assert MofmeExperts(**ex.options()).options() == ex.options()
    assert torch.equal(MofmeExperts(E, H, I).film_gamma, torch.ones(E, I))  # identity FiLM at init
    assert torch.equal(MofmeExperts(E, H, I).film_beta, torch.zeros(E, I))


@pytest.mark.parametrize("options, message", [
    ({"film": "input"}, "film must be one of"), ({"activation": "clamped-swiglu"}, "activation must be one of"),
    ({"num_experts": 0}, "num_experts must be a positive integer")])
def test_experts_refuse_bad_options(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        MofmeExperts(**{"num_experts": E, "hidden_size": H, "intermediate_size": I, **options})


def router(dropout=0.2, samples=5, seed=0, **options):
    torch.manual_seed(seed)
    r = UncertaintyAware(H, E, 2, samples=samples, dropout=dropout, **options)
    with torch.no_grad():
        r.weight.normal_(0, 0.5)
    return r.double()


def test_router_mc_forward_matches_the_token_by_token_reference_with_the_same_masks():
    r = router().train()
    x = torch.randn(7, H, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(3)
    fast = r(x)
    torch.manual_seed(3)
    ref = r.reference(x)
    torch.testing.assert_close(fast.indices, ref.indices)
    torch.testing.assert_close(fast.weights, ref.weights)
    torch.testing.assert_close(fast.logits, ref.logits)
    assert torch.allclose(fast.weights.sum(-1), torch.ones(7, dtype=torch.float64))
    gw = torch.autograd.grad(fast.weights.pow(2).sum() + fast.logits.exp().sin().sum(), [x, r.weight])
    gr = torch.autograd.grad(ref.weights.pow(2).sum() + ref.logits.exp().sin().sum(), [x, r.weight])
    for a, b in zip(gw, gr):  # the softmax runs in float32 (as topk-softmax's), both ways
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the calibrated probabilities are the mean of the samples: softmax of the returned logits, and uncertainty()
    torch.manual_seed(3)
    mean, std = r.uncertainty(x)
    torch.testing.assert_close(F.softmax(fast.logits, -1), mean)
    assert (std > 0).any()


def test_router_at_inference_is_the_deterministic_gate_unless_mc_inference():
    r = router().eval()
    plain = TopKSoftmax(H, E, 2).double()
    plain.weight.data.copy_(r.weight)
    x = torch.randn(7, H, dtype=torch.float64)
    a, b = r(x), plain(x)
    assert torch.equal(a.indices, b.indices) and torch.allclose(a.weights, b.weights)
    assert torch.equal(r(x).weights, a.weights)  # no randomness at inference by default
    check_reference(r, top_k=2)
    mc = router(mc_inference=True).eval()
    assert not torch.equal(mc(x).weights, mc(x).weights)  # MC passes kept at inference: fresh masks each call
    assert torch.equal(router(dropout=0.0).train()(x).weights, router(dropout=0.0).eval()(x).weights)


@pytest.mark.parametrize("options, message", [({"samples": 0}, "samples must be"),
                                              ({"dropout": 0.95}, "dropout must be"),
                                              ({"sample": 3}, "did you mean 'samples'")])
def test_router_refuses_bad_options(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        UncertaintyAware(H, E, 2, **options)


def test_upcycle_to_mofme_starts_as_the_dense_model_and_records_the_kind(tmp_path):
    dense = tiny_dense()
    before, ref = {k: v.clone() for k, v in dense.state_dict().items()}, logits(dense)
    moe = zoo.apply(dense, "upcycle", num_experts=8, top_k=2, experts="mofme")
    layers = moe_layers(moe)
    assert [type(m.experts).__name__ for _, m in layers] == ["MofmeExperts"] * 2
    assert [type(m.router).__name__ for _, m in layers] == ["UncertaintyAware"] * 2
    assert moe.config.zoo_layout[0]["experts"] == "mofme" and moe.config.zoo_layout[0]["router"] == "uncertainty-aware"
    assert moe.config.num_local_experts == 8 and moe.config.num_experts_per_tok == 2
    assert (logits(moe) - ref).abs().max() < 1e-5
    assert all(torch.equal(before[k], v) for k, v in dense.state_dict().items())  # the dense model untouched
    mlp = dense.model.layers[0].mlp
    experts = layers[0][1].experts
    assert torch.equal(experts.gate_up_proj, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    # honest size: the dense model + per layer (E FiLM pairs of width I, a router row per expert)
    params = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert params(moe) == params(dense) + 2 * (2 * 8 * 96 + 8 * COMMON["hidden_size"])
    assert reload_max_diff(moe, IDS, tmp_path / "m") < 1e-6
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert again.config.zoo_layout == moe.config.zoo_layout
    assert torch.equal(moe_layers(again)[1][1].experts.film_gamma, layers[1][1].experts.film_gamma)
    with pytest.raises(Exception, match="'mofme' experts; native mixtral needs dense experts"):
        zoo.export(moe, tmp_path / "native")  # no native family holds FiLM experts: refused, with the reason


@pytest.mark.parametrize("options, message", [({"experts": "mofm"}, "experts must be one of"),
                                              ({"experts": "mofme", "noise": 0.01}, "no copies to perturb")])
def test_upcycle_refuses_bad_mofme_options_and_leaves_the_model(options, message):
    dense = tiny_dense()
    before = {k: v.clone() for k, v in dense.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        zoo.apply(dense, "upcycle", **options)
    assert all(torch.equal(before[k], v) for k, v in dense.state_dict().items()) and type(dense) is MistralForCausalLM


def test_upcycled_mofme_trains_and_its_experts_drift_apart():
    moe = zoo.apply(tiny_dense(), "upcycle", num_experts=4, top_k=2, experts="mofme").train()
    opt = torch.optim.AdamW(moe.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(3):
        out = moe(input_ids=IDS, labels=IDS, output_router_logits=True)
        (out.loss + 0.01 * out.aux_loss).backward()
        opt.step()
        opt.zero_grad()
    for _, m in moe_layers(moe):
        gamma, beta = m.experts.film_gamma, m.experts.film_beta
        assert not torch.equal(gamma, torch.ones_like(gamma)) and not torch.equal(beta, torch.zeros_like(beta))
        assert (gamma - gamma[:1]).abs().max() > 0  # experts got different gradients: they are no longer identical


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "olmo2"])
def test_every_dense_family_upcycles_to_mofme_with_the_dense_logits(family, tmp_path):
    from test_adapters_structure import SIBLING, tiny_dense_of

    dense = tiny_dense_of(family)
    moe = zoo.apply(dense, "upcycle", num_experts=4, top_k=2, experts="mofme")
    assert moe.config.model_type == "zoo_" + SIBLING[family]
    assert all(type(m.experts) is MofmeExperts and m.shared_experts is None for _, m in moe_layers(moe))
    assert (logits(moe) - logits(dense)).abs().max() < 1e-5
    assert reload_max_diff(moe, IDS, tmp_path / "m") < 1e-6
