"""The routers that reproduce families' own routing, against the families' own code as the reference."""
import pytest
import torch
from transformers.models.phimoe.modeling_phimoe import sparsemixer

from zoo_routers.scored_topk import ScoredTopK
from zoo_routers.sparsemixer import SparseMixer


@pytest.mark.parametrize("jitter", [0.0, 0.01, 0.5])
def test_sparsemixer_matches_phimoe_at_inference(jitter):
    torch.manual_seed(0)
    router = SparseMixer(16, 8, 2, jitter_eps=jitter)
    x = torch.randn(64, 16)
    got = router(x)
    weights, indices = sparsemixer(router.gate_logits(x), jitter_eps=jitter, training=False, top_k=2)
    assert torch.equal(got.indices, indices)
    torch.testing.assert_close(got.weights, weights)


def test_sparsemixer_weights_carry_gradient_to_the_gate():
    router = SparseMixer(16, 8, 2, jitter_eps=0.5)
    router(torch.randn(4, 16)).weights.sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_scored_topk_written_out():
    """Sigmoid scores, bias on the scores for selection only, 2 of 4 groups by their two best, renormalised and
    scaled: the rule written out per token."""
    torch.manual_seed(0)
    router = ScoredTopK(16, 8, 2, score="sigmoid", selection_bias=True, n_group=4, topk_group=2,
                        routed_scaling_factor=2.5)
    with torch.no_grad():
        router.e_score_correction_bias.normal_(0, 0.3)
    x = torch.randn(32, 16)
    got = router(x)
    for t in range(32):
        scores = torch.sigmoid(router.weight @ x[t])
        choice = scores + router.e_score_correction_bias
        groups = choice.view(4, 2).sum(-1)  # two experts per group: both are the group's two best
        allowed = torch.zeros(8, dtype=torch.bool)
        for g in groups.topk(2).indices:
            allowed[2 * g: 2 * g + 2] = True
        picked = choice.masked_fill(~allowed, float("-inf")).topk(2).indices
        w = scores[picked] / scores[picked].sum() * 2.5
        assert sorted(got.indices[t].tolist()) == sorted(picked.tolist())
        order = got.indices[t].argsort(), picked.argsort()
        torch.testing.assert_close(got.weights[t][order[0]], w[order[1]])


def test_scored_topk_refuses_bad_options_with_the_reason():
    with pytest.raises(ValueError, match="score must be one of"):
        ScoredTopK(16, 8, 2, score="tanh")
    with pytest.raises(ValueError, match="divisible by n_group"):
        ScoredTopK(16, 8, 2, n_group=3)
    with pytest.raises(ValueError, match="unknown option 'nrom_topk_prob'.*norm_topk_prob"):
        ScoredTopK(16, 8, 2, nrom_topk_prob=True)


@pytest.mark.parametrize("fill", ["zero", "-inf"])
def test_group_fill_zero_is_axk2s_router(fill):
    """A.X-K2 gives experts outside the kept groups a choice score of 0 (not -inf): with a negative selection bias an
    outside expert can then beat an inside one. group_fill="zero" reproduces it; the default rule picks otherwise."""
    from transformers import AXK2Config
    from transformers.models.axk2.modeling_axk2 import AXK2TopkRouter

    config = AXK2Config(hidden_size=16, num_local_experts=8, num_experts_per_tok=2, n_group=4, topk_group=1,
                        norm_topk_prob=True, routed_scaling_factor=2.5)
    native = AXK2TopkRouter(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        native.weight.copy_(torch.randn(8, 16, generator=gen) / 4)
        native.e_score_correction_bias.copy_(-torch.rand(8, generator=gen))  # negative: inside scores can be < 0
    router = ScoredTopK(16, 8, 2, score="sigmoid", selection_bias=True, n_group=4, topk_group=1,
                        routed_scaling_factor=2.5, group_fill=fill)
    router.load_state_dict({"weight": native.weight, "e_score_correction_bias": native.e_score_correction_bias})
    x = torch.randn(64, 16, generator=gen)
    _, weights, indices = native(x)
    got = router(x)
    a, b = got.indices.sort(-1), indices.sort(-1)
    same = torch.equal(a.values, b.values) and torch.allclose(got.weights.gather(1, a.indices),
                                                              weights.gather(1, b.indices))
    assert same == (fill == "zero")
    assert ("group_fill" in router.options) == (fill == "zero")  # the default is not recorded: layouts unchanged
