"""DeepSeek-V4 converts losslessly, hash layers included: ``token-hash`` (Hash Layers, token id -> experts table, the
gate weighting them) and ``scored-topk`` with sqrtsoftplus scores reproduce transformers' two routers; a tiny model
with a hash and a top-k layer gives the native logits converted, in generation with a KV cache, after a save and
reload and from ``zoo.load``, and exports back to the native format, hash table included."""
import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.activations import ACT2FN
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter, DeepseekV4TopKRouter

import zoo
from tests.families.tiny_configs import TINY
from zoo.architectures.family import NotExportable
from zoo.moe.layout import moe_layers
from zoo.moe import RoutingContext, routing_context
from zoo.moe.surgery import keep_experts
from zoo_routers.scored_topk import ScoredTopK
from zoo_routers.token_hash import TokenHash, hash_table

SCORES = {"softmax": lambda x: x.softmax(-1), "sigmoid": torch.sigmoid,
          "sqrtsoftplus": lambda x: torch.sqrt(torch.log1p(torch.exp(x)))}  # written out, not the router's own


def tiny_config(**overrides) -> DeepseekV4Config:
    return DeepseekV4Config(**{**TINY["deepseek_v4"], "moe_intermediate_size": 32, **overrides})


def random_table(vocab: int, k: int, experts: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(vocab)])


def native_model(seed: int = 0, **overrides) -> DeepseekV4ForCausalLM:
    """A tiny native DeepSeek-V4 with a hash layer then a top-k layer, its tables and biases made random (the family
    starts them at zero: every token would go to expert 0 and no bias would matter)."""
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(tiny_config(**overrides)).eval()
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            gate = layer.mlp.gate
            gate.weight.normal_(0, 0.5)
            if layer.mlp.is_hash:
                gate.tid2eid.copy_(random_table(*gate.tid2eid.shape, gate.num_experts, seed=seed + i))
            else:
                gate.e_score_correction_bias.normal_(0, 0.3)
    return model


def batches(vocab=128, n=3):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (rows, length), generator=g) for rows, length in ((2, 10), (1, 17), (3, 5))][:n]


def logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False, **kwargs).logits


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


# ---- token-hash against a per-token loop and against transformers' hash router ------------------------------------

def naive_hash(router: TokenHash, hidden, ids):
    """One token at a time: its table row (an id no expert answers for any more: an empty slot, index E), or the gate's
    top-k for a token without an id; the picked scores renormalised and scaled."""
    E, k = router.num_experts, router.top_k
    indices, weights = [], []
    for t in range(hidden.shape[0]):
        logit = router.weight @ hidden[t] + (0 if router.bias is None else router.bias)
        score = SCORES[router.score](logit)
        if ids[t] < 0:
            picks = score.topk(k).indices.tolist()
        else:
            picks = []
            for table_id in router.tid2eid[ids[t]].tolist():
                column = router.expert_map[:, table_id]
                picks.append(int(column.argmax()) if column.max() > 0 else E)
        w = torch.stack([score[p] if p < E else score.new_zeros(()) for p in picks])
        if router.norm_topk_prob:
            w = w / (w.sum() + 1e-20)
        indices.append(picks)
        weights.append(w * router.routed_scaling_factor)
    return torch.tensor(indices), torch.stack(weights)


@pytest.mark.parametrize("options", [
    {"score": "sqrtsoftplus", "routed_scaling_factor": 1.5},
    {"score": "softmax"},
    {"score": "sigmoid", "norm_topk_prob": False, "routed_scaling_factor": 2.0, "bias": True},
])
def test_token_hash_matches_a_per_token_loop(options):
    torch.manual_seed(0)
    router = TokenHash(16, 6, 2, vocab_size=50, **options).double()  # float64: no summation-order noise
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        if router.bias is not None:
            router.bias.normal_(0, 0.5)
        router.tid2eid.copy_(random_table(50, 2, 6))
    hidden = torch.randn(20, 16, dtype=torch.float64)
    ids = torch.randint(0, 50, (20,))
    ids[3] = -1  # a token without an id (an image patch): the gate's top-k
    got = router(hidden, RoutingContext(input_ids=ids[None]))
    want_indices, want_weights = naive_hash(router, hidden, ids)
    assert torch.equal(got.indices, want_indices)
    torch.testing.assert_close(got.weights, want_weights, rtol=1e-12, atol=1e-14)
    assert got.logits is None  # no balance loss over a fixed selection
    direction = torch.randn(20, 2, dtype=torch.float64)
    grad = torch.autograd.grad((got.weights * direction).sum(), router.weight)[0]
    want_grad = torch.autograd.grad((naive_hash(router, hidden, ids)[1] * direction).sum(), router.weight)[0]
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)


def test_token_hash_after_pruning_and_merging_keeps_the_table_valid():
    """keep_experts slices the expert map with the gate rows: a token hashed to a pruned expert loses that slot;
    merged experts (rows averaged) answer for every member's table ids."""
    torch.manual_seed(0)
    router = TokenHash(16, 4, 2, vocab_size=30, score="sqrtsoftplus")
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
    block = zoo.moe.SparseMoE(router, zoo.moe.SwiGLUExperts(4, 16, 8))
    pruned = keep_experts(block, [0, 2, 3]).router
    assert pruned.expert_map.shape == (3, 4) and pruned.options["table_experts"] == 4
    hidden, ids = torch.randn(30, 16), torch.arange(30)
    got = pruned(hidden, RoutingContext(input_ids=ids[None]))
    want_indices, want_weights = naive_hash(pruned, hidden, ids)
    assert torch.equal(got.indices, want_indices) and (got.indices == 3).any()  # some slots emptied
    torch.testing.assert_close(got.weights, want_weights)
    with torch.no_grad():
        pruned.expert_map.copy_(torch.tensor([[1.0, 0.4, 0, 0], [0, 0.6, 1, 0], [0, 0, 0, 1]]))  # 1 merged into 0, 2
    got = pruned(hidden, RoutingContext(input_ids=ids[None]))
    assert (got.indices < 3).all()  # every table id has an owner again
    assert torch.equal(got.indices, naive_hash(pruned, hidden, ids)[0])


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid"])
def test_token_hash_matches_transformers_hash_router(scoring):
    config = tiny_config(scoring_func=scoring, routed_scaling_factor=2.5)
    torch.manual_seed(0)
    theirs = DeepseekV4HashRouter(config)
    with torch.no_grad():
        theirs.weight.normal_(0, 0.5)
        theirs.tid2eid.copy_(random_table(config.vocab_size, config.num_experts_per_tok, config.n_routed_experts))
    ours = TokenHash(config.hidden_size, config.n_routed_experts, config.num_experts_per_tok,
                     vocab_size=config.vocab_size, score=scoring, routed_scaling_factor=2.5)
    ours.load_state_dict({"weight": theirs.weight, "tid2eid": theirs.tid2eid}, strict=False)
    hidden = torch.randn(2, 9, config.hidden_size)
    ids = torch.randint(0, config.vocab_size, (2, 9))
    logits_, weights, indices = theirs(hidden, ids)
    got = ours(hidden.reshape(-1, config.hidden_size), RoutingContext(input_ids=ids))
    assert torch.equal(got.indices, indices)
    torch.testing.assert_close(got.weights, weights, rtol=1e-6, atol=1e-7)
    assert got.logits is None and logits_.shape == (18, config.n_routed_experts)  # transformers records none either


def test_token_hash_needs_the_token_ids():
    router = TokenHash(16, 4, 2, vocab_size=10)
    with pytest.raises(ValueError, match="routes each token by its id: it needs the input ids"):
        router(torch.randn(3, 16))
    with pytest.raises(ValueError, match="routes each token by its id"):
        router(torch.randn(3, 16), RoutingContext(positions=torch.arange(3)[None]))


def test_hash_table_is_balanced_with_distinct_experts_per_token():
    for vocab, k, experts in ((128, 2, 4), (1000, 6, 16), (129280, 6, 256), (7, 3, 3)):
        table = hash_table(vocab, k, experts)
        assert table.shape == (vocab, k) and table.dtype == torch.long
        assert all(len(set(row)) == k for row in table[:500].tolist())
        for j in range(k):
            counts = torch.bincount(table[:, j], minlength=experts)
            assert counts.max() - counts.min() <= 1, (vocab, k, experts, j)
    assert not torch.equal(hash_table(128, 1, 4)[:4, 0], torch.arange(4))  # neighbouring ids are scattered


def test_init_weights_fills_the_table_that_a_checkpoint_lacks():
    router = TokenHash(16, 4, 2, vocab_size=40)
    with torch.no_grad():
        router.tid2eid.zero_()
        router.expert_map.zero_()
    router.init_weights(0.02)
    assert torch.equal(router.tid2eid, hash_table(40, 2, 4)) and torch.equal(router.expert_map, torch.eye(4))
    router.tid2eid._is_hf_initialized = True  # loaded from a checkpoint: kept
    with torch.no_grad():
        router.tid2eid.fill_(3)
    router.init_weights(0.02)
    assert (router.tid2eid == 3).all()


def test_token_hash_applies_to_any_family_and_round_trips(tmp_path):
    from tiny import tiny_native

    model = tiny_native("qwen3_moe")
    with pytest.raises(ValueError, match="vocab_size=64, but this model's vocabulary has 128 tokens"):
        zoo.apply(model, "token-hash", vocab_size=64)
    with pytest.raises(ValueError, match=r"vocab_size must be an integer in \[1, 16777216\]"):
        TokenHash(16, 4, 1, vocab_size=10**9)
    zoo.apply(model, "token-hash", score="sigmoid")  # the table is the model's vocabulary: filled in
    assert moe_layers(model)[0][1].router.vocab_size == 128
    assert model.config.zoo_recipe[-1]["options"] == {"score": "sigmoid"}  # as given
    ids = torch.tensor([[5, 9, 5, 12, 9, 5]])
    seen = []
    _, moe = moe_layers(model)[0]
    hook = moe.experts.register_forward_hook(lambda m, args, out: seen.append(args[1].indices.clone()))
    out = logits(model, ids)
    hook.remove()
    assert torch.equal(seen[0], hash_table(128, moe.top_k, moe.num_experts)[ids[0]])
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert torch.equal(logits(again, ids), out)


# ---- scored-topk: the sqrtsoftplus score -----------------------------------------------------------------------------

def test_sqrtsoftplus_is_transformers_activation():
    x = torch.randn(1000) * 30
    assert torch.equal(zoo_routers_score("sqrtsoftplus")(x), ACT2FN["sqrtsoftplus"](x))


def zoo_routers_score(name):
    from zoo_routers.scored_topk import SCORE_FUNCTIONS

    return SCORE_FUNCTIONS[name]


@pytest.mark.parametrize("scale", [1.0, 1.5])
def test_scored_topk_sqrtsoftplus_matches_transformers_topk_router(scale):
    config = tiny_config(routed_scaling_factor=scale)
    torch.manual_seed(0)
    theirs = DeepseekV4TopKRouter(config)
    with torch.no_grad():
        theirs.weight.normal_(0, 0.5)
        theirs.e_score_correction_bias.normal_(0, 0.3)
    ours = ScoredTopK(config.hidden_size, config.n_routed_experts, config.num_experts_per_tok, score="sqrtsoftplus",
                      selection_bias=True, routed_scaling_factor=scale)
    ours.load_state_dict(theirs.state_dict())
    hidden = torch.randn(64, config.hidden_size)
    logits_, weights, indices = theirs(hidden)
    got = ours(hidden)
    a, b = indices.sort(-1), got.indices.sort(-1)  # transformers' top-k is unsorted
    assert torch.equal(a.values, b.values)
    torch.testing.assert_close(got.weights.gather(1, b.indices), weights.gather(1, a.indices), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got.logits, logits_)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_scored_topk_other_scores_are_bit_identical_to_before(score):
    """The former rule, written out: softmax or sigmoid, bias on the scores for selection only, renormalised."""
    torch.manual_seed(0)
    router = ScoredTopK(16, 8, 3, score=score, selection_bias=True, routed_scaling_factor=2.0)
    with torch.no_grad():
        router.e_score_correction_bias.normal_(0, 0.3)
    hidden = torch.randn(40, 16)
    logits_ = torch.nn.functional.linear(hidden, router.weight)
    scores = logits_.softmax(-1) if score == "softmax" else logits_.sigmoid()
    indices = (scores + router.e_score_correction_bias).topk(3, dim=-1).indices
    weights = scores.gather(1, indices)
    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * 2.0
    got = router(hidden)
    assert torch.equal(got.indices, indices) and torch.equal(got.weights, weights)


# ---- the model ---------------------------------------------------------------------------------------------------------

def test_converts_losslessly_hash_layers_included():
    native = native_model()
    want = [logits(native, ids) for ids in batches()]
    model = zoo.convert(native)
    assert [(i, moe.router.name) for i, moe in moe_layers(model)] == [(0, "token-hash"), (1, "scored-topk")]
    assert moe_layers(model)[0][1].router.options["score"] == "sqrtsoftplus"
    for ids, expected in zip(batches(), want):
        got = logits(model, ids)
        assert max_diff(got, expected) <= 1e-5 * expected.abs().max().item(), max_diff(got, expected)
    # the hash layer really routes by the table (not the gate's top-k)
    seen = []
    _, hashed = moe_layers(model)[0]
    hook = hashed.experts.register_forward_hook(lambda m, args, out: seen.append(args[1].indices.clone()))
    ids = batches()[0]
    logits(model, ids)
    hook.remove()
    assert torch.equal(seen[0], hashed.router.tid2eid[ids.reshape(-1)])


def test_balance_loss_is_the_native_one():
    """DeepSeek-V4 records router logits of its top-k layers only: the converted model's aux loss is the same."""
    native = native_model()
    ids, mask = batches()[0], torch.ones(2, 10, dtype=torch.long)
    with torch.no_grad():
        want = native(input_ids=ids, attention_mask=mask, output_router_logits=True, use_cache=False)
        got = zoo.convert(native)(input_ids=ids, attention_mask=mask, output_router_logits=True, use_cache=False)
    assert len(got.router_logits) == len(want.router_logits) == 1
    torch.testing.assert_close(got.aux_loss, want.aux_loss)


def test_generation_with_a_kv_cache_routes_each_steps_tokens():
    native = native_model()
    prompt = batches()[0]
    mask = torch.ones_like(prompt)
    with torch.no_grad():
        want = native.generate(prompt, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    model = zoo.convert(native)
    steps = []
    _, hashed = moe_layers(model)[0]
    hook = hashed.router.register_forward_hook(lambda m, args, out: steps.append(args[1].input_ids.clone()))
    with torch.no_grad():
        got = model.generate(prompt, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    hook.remove()
    assert torch.equal(got, want)
    assert [s.shape[1] for s in steps] == [prompt.shape[1]] + [1] * 5  # each step's own tokens
    assert torch.equal(torch.cat(steps[1:], 1), got[:, prompt.shape[1]:-1])


def test_saved_model_reloads_with_the_same_logits(tmp_path):
    native = native_model()
    ids = batches()[0]
    want = logits(native, ids)
    model = zoo.convert(native)
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(again).__name__ == "ZooDeepseekV4ForCausalLM"
    assert again.config.zoo_layout == model.config.zoo_layout
    assert torch.equal(moe_layers(again)[0][1].router.tid2eid, moe_layers(model)[0][1].router.tid2eid)
    assert max_diff(logits(again, ids), want) <= 1e-5 * want.abs().max().item()


def test_zoo_load_converts_a_native_checkpoint(tmp_path):
    native = native_model()
    ids = batches()[1]
    want = logits(native, ids)
    native.save_pretrained(tmp_path)
    model = zoo.load(str(tmp_path)).eval()
    assert type(model).__name__ == "ZooDeepseekV4ForCausalLM"
    assert max_diff(logits(model, ids), want) <= 1e-5 * want.abs().max().item()


def test_exports_to_the_native_format_hash_table_included(tmp_path):
    native = native_model()
    ids = batches()[0]
    want = logits(native, ids)
    table = native.model.layers[0].mlp.gate.tid2eid.clone()
    model = zoo.convert(native)
    zoo.export(model, tmp_path)
    again = DeepseekV4ForCausalLM.from_pretrained(tmp_path).eval()
    assert torch.equal(again.model.layers[0].mlp.gate.tid2eid, table)
    assert max_diff(logits(again, ids), want) <= 1e-5 * want.abs().max().item()


def test_a_pruned_hash_layer_has_no_native_form(tmp_path):
    model = zoo.convert(native_model())
    i, moe = moe_layers(model)[0]
    model.model.layers[i].mlp = keep_experts(moe, [0, 1, 3])
    with pytest.raises(NotExportable, match="hash table names 4 experts but the layer has 3"):
        zoo.export(model, tmp_path / "native")
    assert not (tmp_path / "native").exists()
