"""otp: MC#'s online top-any pruning. Against a naive per-token loop (outputs and gradients), only ever removes
experts from the base top-k set, starts as exactly the base routing, trains with the Gumbel-softmax straight-through
estimator and its sparsity penalty, and trains through zoo.training.finetune (only the pruner moves), saving and reloading."""
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

import zoo
from zoo.moe.layout import moe_layers
from zoo.editing.snapshot import Fingerprint
from zoo.testing import check_component, tiny_model
from zoo.testing.reference import check_reference
from zoo_routers.otp import OnlineTopAnyPruning
from zoo_routers.topk_softmax import TopKSoftmax


def random_pruner(router, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.prune_weight.copy_(torch.randn(router.prune_weight.shape, generator=g))
        router.prune_bias.copy_(torch.randn(router.prune_bias.shape, generator=g))
    return router


@pytest.mark.parametrize("k, norm, threshold", [(2, True, 0.5), (3, True, 0.7), (3, False, 0.5), (4, True, 0.3)])
def test_forward_matches_the_per_token_loop(k, norm, threshold):
    torch.manual_seed(k)
    router = random_pruner(OnlineTopAnyPruning(16, 6, k, keep_threshold=threshold, norm_topk_prob=norm).eval(), k)
    check_reference(router, k, tokens=24)
    routing = router(torch.randn(64, 16))
    kept = (routing.indices < 6).sum(-1)
    assert kept.min() >= 1 and kept.max() <= k and len(set(kept.tolist())) > 1  # some tokens lose experts, not all


def test_it_only_removes_experts_from_the_base_top_k():
    torch.manual_seed(1)
    router = random_pruner(OnlineTopAnyPruning(16, 8, 3).eval(), 1)
    base = TopKSoftmax(16, 8, 3)
    base.load_state_dict({"weight": router.weight.detach().clone()})
    x = torch.randn(50, 16)
    pruned, full = router(x), base(x)
    for t in range(50):
        chosen = set(pruned.indices[t][pruned.indices[t] < 8].tolist())
        assert chosen <= set(full.indices[t].tolist())
        assert int(full.indices[t, 0]) in chosen  # the most probable expert is always kept
    torch.testing.assert_close(pruned.logits, full.logits)


def test_untrained_it_is_the_base_routing_and_a_higher_threshold_drops_weak_experts():
    torch.manual_seed(2)
    router = OnlineTopAnyPruning(16, 8, 2)
    with torch.no_grad():
        router.weight.normal_()  # a peaked gate, as a trained one: second-expert weights spread over (0, 0.5]
    assert not router.training  # built deterministic: zoo.apply may put it into a model already in eval mode
    base = TopKSoftmax(16, 8, 2)
    base.load_state_dict({"weight": router.weight.detach().clone()})
    x = torch.randn(200, 16)
    a, b = router(x), base(x)
    assert torch.equal(a.indices, b.indices)
    torch.testing.assert_close(a.weights, b.weights)
    strict = OnlineTopAnyPruning(16, 8, 2, keep_threshold=0.97)
    strict.load_state_dict(router.state_dict())
    r = strict(x)
    dropped = r.indices[:, 1] == 8
    assert 0 < int(dropped.sum()) < 200
    # the dropped second experts are the ones with the smallest weight
    assert b.weights[dropped, 1].max() < b.weights[~dropped, 1].min()
    torch.testing.assert_close(r.weights[dropped, 0], torch.ones(int(dropped.sum())))


def test_training_draws_straight_through_masks_and_the_penalty_lowers_keep_probability():
    torch.manual_seed(3)
    router = random_pruner(OnlineTopAnyPruning(16, 6, 3, sparsity=1.0, temperature=0.5), 3)
    router.train()
    x = torch.randn(256, 16)
    routing = router(x)
    assert (routing.indices < 6).all()  # every top-k expert is computed while training (weight 0 when dropped)
    zero = routing.weights == 0
    assert zero[:, 0].sum() == 0 and zero[:, 1:].any()  # dropped slots exist; the first never is
    # gradients reach the pruner through the relaxed mask (the language-model side) and the penalty
    (routing.weights * torch.randn_like(routing.weights)).sum().backward()
    assert router.prune_weight.grad.abs().sum() > 0
    before = torch.sigmoid(router.keep_logits(x, router.top_k_weights(router.gate_logits(x))[0])[:, 1:]).mean()
    opt = torch.optim.SGD(router.trainable_parameters(), lr=2.0)
    for _ in range(20):
        opt.zero_grad()
        router(x)
        router.train_loss().backward()
        opt.step()
    after = torch.sigmoid(router.keep_logits(x, router.top_k_weights(router.gate_logits(x))[0])[:, 1:]).mean()
    assert after < before - 0.1
    router.eval()
    assert router(x).indices.eq(6).any() and router.train_loss() is None


@pytest.mark.parametrize("options, message", [
    ({"keep_threshold": 1.0}, "keep_threshold must be a probability"),
    ({"keep_threshold": 0.0}, "keep_threshold must be a probability"),
    ({"temperature": 0}, "temperature must be a number"),
    ({"sparsity": -1.0}, "sparsity must be a number"),
    ({"top_k": 1}, "needs top_k >= 2"),
    ({"keep_threshold": "high"}, "keep_threshold"),
])
def test_bad_options_are_refused_and_the_model_is_untouched(options, message):
    model = zoo.convert(tiny_model("mixtral"))
    before = Fingerprint(model)
    with pytest.raises((ValueError, TypeError), match=message):
        zoo.apply(model, "otp", **options)
    assert before.same_as(model) and model.config.zoo_recipe == []


def test_check_component():
    report = check_component("otp", families=["mixtral", "qwen2_moe"], keep_threshold=0.9)
    assert report["references"] == ["OnlineTopAnyPruning"] and report["max_logit_diff"] <= 1e-6


def test_finetune_trains_only_the_pruner_and_the_result_reloads(tmp_path):
    from zoo.training.finetune import finetune

    torch.manual_seed(0)
    base = zoo.load("zoo-tiny-moe", dtype=torch.float32)
    result = finetune(copy.deepcopy(base), "otp", {"sparsity": 0.5}, domain="code", steps=3, lr=0.05, batch_size=1,
                      seq_len=32, windows=1, threads=1, bf16=False, progress=False, out=str(tmp_path / "m"))
    tuned = result.model
    k = base.config.num_experts_per_tok
    assert result.trainable_params == len(moe_layers(tuned)) * (k * (base.config.hidden_size + k) + k)
    routers = [m.router for _, m in moe_layers(tuned)]
    assert all(isinstance(r, OnlineTopAnyPruning) for r in routers)
    fresh = OnlineTopAnyPruning(base.config.hidden_size, base.config.num_local_experts, k)
    assert any(not torch.equal(r.prune_bias, fresh.prune_bias) for r in routers)  # the pruner moved
    base_state = base.state_dict()
    for name, value in tuned.state_dict().items():  # everything else is the base model, gates included
        if "prune_" not in name:
            assert torch.equal(value, base_state[name]), name
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, tuned.eval()(input_ids=ids).logits)


def test_finetune_refuses_a_router_it_cannot_train():
    from zoo.training.finetune import finetune

    with pytest.raises(ValueError, match="is a router, not an adapter"):
        finetune("zoo-tiny-moe", "expert-choice", {}, steps=1)
