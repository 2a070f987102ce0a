"""TopKSoftmax and SigmoidBias (DeepSeek-V3) routers against explicit reference computations."""
import math

import pytest
import torch

from zoo.moe import Routing
from zoo_routers.sigmoid_bias import SigmoidBias
from zoo_routers.topk_softmax import TopKSoftmax

H = 12


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest


def spread_(router, std=0.5):
    with torch.no_grad():
        for prm in router.parameters():
            prm.normal_(0.0, std)
    return router


# ------------------------------------------------------------------------------------- TopKSoftmax

def ref_topk_softmax(x, weight, bias, k, norm_topk_prob):
    logits = x @ weight.T + (0 if bias is None else bias)
    e = torch.exp(logits - logits.max(-1, keepdim=True).values)
    probs = e / e.sum(-1, keepdim=True)
    indices = torch.argsort(probs, dim=-1, descending=True)[:, :k]
    weights = probs.gather(1, indices)
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, indices, logits


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["norm", "nonorm"])
@pytest.mark.parametrize("num_experts,k", [(4, 1), (8, 2), (16, 4), (6, 6)])
def test_topk_softmax_matches_reference(num_experts, k, norm_topk_prob, bias):
    torch.manual_seed(num_experts * 10 + k)
    router = spread_(TopKSoftmax(H, num_experts, k, bias=bias, norm_topk_prob=norm_topk_prob))
    assert router.options == {"bias": bias, "norm_topk_prob": norm_topk_prob}
    x = torch.randn(33, H, requires_grad=True)
    routing = router(x)
    assert isinstance(routing, Routing)
    assert routing.weights.shape == routing.indices.shape == (33, k)
    assert routing.indices.dtype == torch.long

    w_ref, i_ref, logits_ref = ref_topk_softmax(x, router.weight, router.bias, k, norm_topk_prob)
    assert torch.equal(routing.indices, i_ref)
    torch.testing.assert_close(routing.weights, w_ref)
    torch.testing.assert_close(routing.logits, logits_ref)
    if norm_topk_prob:
        torch.testing.assert_close(routing.weights.sum(-1), torch.ones(33))
    else:
        assert (routing.weights.sum(-1) < 1 + 1e-6).all()
        if k < num_experts:
            assert (routing.weights.sum(-1) < 1 - 1e-3).any()

    # gradients reach the router's weight (and bias) through the kept probabilities
    g = torch.randn(33, k)
    grads = torch.autograd.grad((routing.weights * g).sum(), [x, *router.parameters()])
    grads_ref = torch.autograd.grad((w_ref * g).sum(), [x, *router.parameters()])
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want)


def test_topk_softmax_bf16_weights_come_from_fp32_softmax():
    torch.manual_seed(1)
    router = spread_(TopKSoftmax(H, 8, 2, norm_topk_prob=False)).to(torch.bfloat16)
    x = torch.randn(16, H).to(torch.bfloat16)
    routing = router(x)
    assert routing.weights.dtype == torch.bfloat16
    logits = (x @ router.weight.T).float()  # the bf16 logits, softmaxed in fp32
    probs = logits.softmax(-1)
    torch.testing.assert_close(routing.weights.float(), probs.gather(1, routing.indices), rtol=8e-3, atol=1e-3)
    assert torch.equal(routing.indices.sort(-1).values, probs.topk(2, -1).indices.sort(-1).values)


# ------------------------------------------------------------------------------------- SigmoidBias

def ref_deepseek_v3(logits, correction, k, n_group, topk_group, norm_topk_prob, scale):
    """DeepSeek-V3 routing, one token at a time, written out with Python lists."""
    num_experts = logits.shape[-1]
    size = num_experts // n_group
    all_idx, all_w = [], []
    for row in logits:
        scores = torch.sigmoid(row)
        biased = (scores + correction).tolist()
        groups = [list(range(g * size, (g + 1) * size)) for g in range(n_group)]
        group_score = [sum(sorted((biased[e] for e in grp), reverse=True)[:2]) for grp in groups]
        kept_groups = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
        candidates = [e for g in kept_groups for e in groups[g]]
        chosen = sorted(candidates, key=lambda e: -biased[e])[:k]
        w = scores[chosen]  # unbiased affinities
        if norm_topk_prob:
            w = w / (w.sum() + 1e-20)
        all_idx.append(chosen)
        all_w.append(w * scale)
    return torch.stack(all_w), torch.tensor(all_idx)


def by_index(weights, indices):
    """Sort each row's slots by expert id, so slot order does not matter in comparisons."""
    order = indices.argsort(-1)
    return weights.gather(1, order), indices.gather(1, order)


@pytest.mark.parametrize("norm_topk_prob,scale", [(True, 1.0), (True, 2.5), (False, 1.0), (False, 2.5)])
@pytest.mark.parametrize("num_experts,k,n_group,topk_group", [
    (8, 2, 1, 1),  # no grouping
    (8, 2, 4, 2),  # groups of 2, as in the tiny DeepSeek-V3 config
    (16, 4, 4, 2),
    (16, 3, 8, 3),
    (8, 2, 8, 4),  # groups of one expert: the group score is that expert's score
    (32, 8, 8, 4),  # DeepSeek-V3's own grouping, scaled down
])
def test_sigmoid_bias_matches_deepseek_v3_reference(num_experts, k, n_group, topk_group, norm_topk_prob, scale):
    torch.manual_seed(num_experts + 3 * k + 7 * n_group + topk_group)
    router = spread_(SigmoidBias(H, num_experts, k, n_group=n_group, topk_group=topk_group,
                                 norm_topk_prob=norm_topk_prob, routed_scaling_factor=scale), std=0.4)
    router.e_score_correction_bias.normal_(0.0, 0.3)  # comparable to the spread of the scores
    x = torch.randn(40, H)
    routing = router(x)

    logits = x @ router.weight.T
    torch.testing.assert_close(routing.logits, logits)
    w_ref, i_ref = ref_deepseek_v3(logits, router.e_score_correction_bias, k, n_group, topk_group,
                                   norm_topk_prob, scale)
    w, i = by_index(routing.weights, routing.indices)
    w_ref, i_ref = by_index(w_ref, i_ref)
    assert torch.equal(i, i_ref)
    torch.testing.assert_close(w, w_ref)
    if norm_topk_prob:
        torch.testing.assert_close(routing.weights.sum(-1), torch.full((40,), scale))
    # selection stays inside topk_group groups
    groups_used = (routing.indices // (num_experts // n_group)).tolist()
    assert max(len(set(row)) for row in groups_used) <= topk_group


def test_sigmoid_bias_steers_selection_only():
    torch.manual_seed(2)
    router = spread_(SigmoidBias(H, 8, 2, norm_topk_prob=False))
    x = torch.randn(30, H)
    plain = router(x)
    scores = torch.sigmoid(x @ router.weight.T)
    # unbiased: the two highest affinities
    assert torch.equal(plain.indices.sort(-1).values, scores.topk(2, -1).indices.sort(-1).values)

    # a large bias on expert 6 makes every token pick it, though its affinity is unchanged
    router.e_score_correction_bias[6] = 5.0
    steered = router(x)
    assert (steered.indices == 6).any(-1).all()
    assert not torch.equal(steered.indices, plain.indices)
    # ...and the weights are still the plain sigmoid scores of the chosen experts, with no bias in them
    torch.testing.assert_close(steered.weights, scores.gather(1, steered.indices))
    assert (steered.weights < 1).all()
    # the logits handed to the losses are the unbiased ones too
    torch.testing.assert_close(steered.logits, plain.logits)
    # the correction bias is a buffer (aux-loss-free balancing), not a trained parameter
    assert "e_score_correction_bias" in dict(router.named_buffers())
    assert "e_score_correction_bias" not in dict(router.named_parameters())


def test_sigmoid_bias_group_limit_by_hand():
    # One token, 8 experts in 4 groups of 2, keep 2 groups, pick 2 experts. Expert 0 has the best single
    # score but its group's top-2 sum is weak; groups 1 and 2 win, so experts 2..5 are the candidates.
    target = torch.tensor([0.99, 0.01, 0.60, 0.62, 0.55, 0.58, 0.10, 0.12])
    router = SigmoidBias(1, 8, 2, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    with torch.no_grad():
        router.weight.copy_(torch.log(target / (1 - target))[:, None])  # logit, so sigmoid(w * 1) = target
    routing = router(torch.ones(1, 1))
    assert sorted(routing.indices[0].tolist()) == [2, 3]
    expected = torch.tensor([0.60, 0.62]) / (0.60 + 0.62) * 2.5
    torch.testing.assert_close(routing.weights[0].sort().values, expected)

    ungrouped = SigmoidBias(1, 8, 2, n_group=1, topk_group=1)
    with torch.no_grad():
        ungrouped.weight.copy_(router.weight)
    assert sorted(ungrouped(torch.ones(1, 1)).indices[0].tolist()) == [0, 3]

    # The group score uses the *biased* scores: lifting expert 1 to 0.71 makes group 0 the best group
    # (0.99 + 0.71 = 1.70; unbiased it would still lose with 1.00), and expert 1 now beats 2 and 3.
    # Its weight stays its unbiased affinity, 0.01.
    router.e_score_correction_bias[1] = 0.7
    routing = router(torch.ones(1, 1))
    assert sorted(routing.indices[0].tolist()) == [0, 1]
    expected = torch.tensor([0.01, 0.99]) / (0.99 + 0.01) * 2.5
    torch.testing.assert_close(routing.weights[0].sort().values, expected)


def test_sigmoid_bias_renormalisation_epsilon():
    # all kept affinities underflow to zero: the +1e-20 keeps the weights finite (zeros, not NaN)
    router = SigmoidBias(1, 4, 2, norm_topk_prob=True)
    with torch.no_grad():
        router.weight.fill_(-200.0)
    routing = router(torch.ones(3, 1))
    assert torch.isfinite(routing.weights).all()
    assert torch.count_nonzero(routing.weights) == 0


def test_sigmoid_bias_bf16_hidden():
    torch.manual_seed(3)
    router = spread_(SigmoidBias(H, 8, 2, n_group=4, topk_group=2, routed_scaling_factor=2.5))
    x = torch.randn(10, H).to(torch.bfloat16)
    routing = router(x)
    assert routing.weights.dtype == torch.bfloat16
    assert routing.logits.dtype == torch.float32  # scoring happens in fp32
    w_ref, i_ref = ref_deepseek_v3(x.float() @ router.weight.T, router.e_score_correction_bias, 2, 4, 2, True, 2.5)
    w, i = by_index(routing.weights, routing.indices)
    w_ref, i_ref = by_index(w_ref, i_ref)
    assert torch.equal(i, i_ref)
    torch.testing.assert_close(w.float(), w_ref, rtol=8e-3, atol=1e-2)


# -------------------------------------------------------------------------------------- validation

@pytest.mark.parametrize("cls", [TopKSoftmax, SigmoidBias])
@pytest.mark.parametrize("top_k", [0, 9])
def test_top_k_out_of_range_raises(cls, top_k):
    with pytest.raises(ValueError, match="top_k"):
        cls(H, 8, top_k)


@pytest.mark.parametrize("n_group,topk_group,top_k,match", [
    (3, 1, 2, "divisible by n_group"),
    (4, 5, 2, "topk_group"),
    (4, 0, 2, None),  # 0 means "not set" (-> 1), as with None in a config
    (4, 1, 3, "exceeds"),  # only 2 experts in 1 group of 2
])
def test_sigmoid_bias_invalid_groups(n_group, topk_group, top_k, match):
    if match is None:
        assert SigmoidBias(H, 8, 2, n_group=n_group, topk_group=topk_group).topk_group == 1
        return
    with pytest.raises(ValueError, match=match):
        SigmoidBias(H, 8, top_k, n_group=n_group, topk_group=topk_group)


def test_sigmoid_bias_none_groups_mean_one():
    router = SigmoidBias(H, 8, 2, n_group=None, topk_group=None)
    assert (router.n_group, router.topk_group) == (1, 1)


@pytest.mark.parametrize("cls", [TopKSoftmax, SigmoidBias])
def test_unknown_option_suggests_the_right_name(cls):
    with pytest.raises(ValueError, match=r"unknown option 'norm_top_k_prob'.*did you mean 'norm_topk_prob'"):
        cls(H, 8, 2, norm_top_k_prob=False)
    with pytest.raises(ValueError, match="unknown option 'frobnicate'") as info:
        cls(H, 8, 2, frobnicate=1)
    assert "did you mean" not in str(info.value)


def test_options_are_recorded_for_rebuilding():
    router = SigmoidBias(H, 16, 4, n_group=4, topk_group=2, routed_scaling_factor=2.5, bias=True)
    assert router.options == {"bias": True, "n_group": 4, "topk_group": 2, "norm_topk_prob": True,
                              "routed_scaling_factor": 2.5}
    rebuilt = SigmoidBias(H, 16, 4, **router.options)
    assert rebuilt.options == router.options and rebuilt.bias is not None
    assert math.isclose(rebuilt.routed_scaling_factor, 2.5)


def test_routing_is_the_three_field_tuple_of_the_contract_with_extras_beside_it():
    """Routing(weights, indices, logits) unpacks and iterates as three (plugins written against the contract
    keep working: a toy checker rebuilds a routing by zipping its fields); ``shared_weights`` and ``state`` ride as
    keyword-only extras that ``_replace`` and copies keep, also inside a fully compiled graph."""
    import copy

    x = torch.randn(4, 3)
    r = Routing(x.softmax(-1), x.argmax(-1, keepdim=True), x, state=x * 2)
    weights, indices, logits = r
    assert len(r) == 3 and r[2] is logits and r.shared_weights is None and torch.equal(r.state, x * 2)
    rebuilt = Routing(*(torch.cat(parts) for parts in zip(r, r)))
    assert rebuilt.weights.shape == (8, 3) and rebuilt.state is None
    moved = r._replace(weights=r.weights * 2)
    assert moved.state is r.state and torch.equal(moved.weights, r.weights * 2)
    assert torch.equal(copy.deepcopy(r).state, r.state)
    with pytest.raises(TypeError):
        Routing(x, x, x, x)  # the extras are keywords only

    def step(t):
        got = Routing(t.softmax(-1), t.argmax(-1, keepdim=True), shared_weights=t[:, :1])._replace(logits=t)
        return got.weights.sum() + got.shared_weights.sum() + got[2].sum()

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(step, fullgraph=True)(x), step(x))
