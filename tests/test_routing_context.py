"""The routing context: every router that declares ``uses_context`` gets the token ids, positions, attention mask
and modality tags of the call it runs in, the same way in every family; a hash router (Hash Layers) routes by
token id through it, in a plain forward, in generation with a KV cache, and after a save and reload."""
import pytest
import torch

import zoo
from tiny import tiny_native
from zoo.moe.layout import moe_layers
from zoo.moe import Router, Routing, RoutingContext, routing_context
from zoo.moe.context import TEXT, VISION
from zoo.components.registry import Registered, registry


class HashRouter(Router):
    """Hash Layers (Roller et al., 2021): token id -> a fixed expert, weight 1."""

    name = "test-hash"
    uses_context = True

    def __init__(self, hidden_size, num_experts, top_k=1, seed: int = 0, **options):
        super().__init__(hidden_size, num_experts, top_k, seed=seed, **options)
        self.seen = []  # contexts this router was called with (for the test)

    def forward(self, hidden, context=None):
        if context is None or context.input_ids is None:
            raise ValueError("test-hash routes by token id: it needs the routing context of a model call")
        ids = context.rows("input_ids", hidden.shape[0])
        self.seen.append(context)
        expert = (ids * 7 + self.options["seed"]) % self.num_experts
        return Routing(weights=torch.ones(len(ids), 1, dtype=hidden.dtype), indices=expert[:, None],
                       logits=self.gate_logits(hidden))


@pytest.fixture
def hash_router():
    registry.add_all([Registered("router", HashRouter.name, HashRouter, "tests", "moe-zoo-test-hash", "0.1")])
    yield HashRouter
    registry.entries["router"].pop(HashRouter.name)


def chosen(model, ids, **kwargs):
    """Per MoE layer, the expert each token went to."""
    picks = []
    hooks = [moe.experts.register_forward_hook(lambda m, args, out: picks.append(args[1].indices[:, 0].clone()))
             for _, moe in moe_layers(model)]
    try:
        with torch.no_grad():
            model(input_ids=ids, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return picks


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_hash_router_routes_by_token_id_in_every_family(family, hash_router):
    model = zoo.apply(tiny_native(family), "test-hash", top_k=1, seed=3)
    ids = torch.tensor([[5, 9, 5, 12, 9, 5]])
    for picks in chosen(model, ids):
        assert picks.tolist() == ((ids[0] * 7 + 3) % moe_layers(model)[0][1].num_experts).tolist()
    router = moe_layers(model)[0][1].router
    context = router.seen[-1]
    assert context.positions.tolist() == [list(range(6))]
    assert context.modality.tolist() == [[TEXT] * 6]


def test_context_follows_generation_with_a_kv_cache(hash_router):
    model = zoo.apply(tiny_native("mixtral"), "test-hash")
    router = moe_layers(model)[0][1].router
    prompt = torch.tensor([[3, 4, 5, 6]])
    mask = torch.ones_like(prompt)
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=mask, max_new_tokens=3, do_sample=False)
    steps = [c for c in router.seen]
    assert steps[0].input_ids.tolist() == [[3, 4, 5, 6]]
    assert [c.input_ids.tolist() for c in steps[1:]] == [[[t]] for t in out[0, 4:6].tolist()]
    assert [c.positions.tolist() for c in steps[1:]] == [[[4]], [[5]]]  # counted on from the cache
    # generate drops an all-ones mask; a padded batch keeps one, cut to each call's own columns
    router.seen.clear()
    prompt, mask = torch.tensor([[0, 3, 4, 5], [6, 7, 8, 9]]), torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    with torch.no_grad():
        model.generate(prompt, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert router.seen[0].attention_mask.tolist() == mask.tolist()
    assert [c.attention_mask.shape for c in router.seen[1:]] == [(2, 1)]


def test_saved_and_reloaded_model_keeps_routing_by_token(hash_router, tmp_path):
    from transformers import AutoModelForCausalLM

    model = zoo.apply(tiny_native("qwen3_moe"), "test-hash", seed=1)
    model.save_pretrained(tmp_path)
    assert model.config.zoo_components["router:test-hash"] == {"distribution": "moe-zoo-test-hash", "version": "0.1"}
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.tensor([[7, 8, 9, 7]])
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, model.eval()(input_ids=ids).logits)


def test_a_missing_plugin_names_the_package_to_install(hash_router, tmp_path):
    from transformers import AutoModelForCausalLM

    zoo.apply(tiny_native("mixtral"), "test-hash").save_pretrained(tmp_path)
    assert "moe-zoo-test-hash" in (tmp_path / "README.md").read_text()  # the card's install line
    registry.entries["router"].pop(HashRouter.name)
    try:
        with pytest.raises(ValueError, match=r"needs the router 'test-hash' from moe-zoo-test-hash 0\.1, which is not "
                                             r"installed: pip install moe-zoo-test-hash"):
            AutoModelForCausalLM.from_pretrained(tmp_path)
    finally:
        registry.entries["router"][HashRouter.name] = Registered("router", HashRouter.name, HashRouter, "tests",
                                                                 "moe-zoo-test-hash", "0.1")


def test_a_block_outside_a_model_call_gets_no_context_unless_given(hash_router):
    model = zoo.apply(tiny_native("mixtral"), "test-hash")
    block = moe_layers(model)[0][1]
    x = torch.randn(1, 3, 64)
    with pytest.raises(ValueError, match="needs the routing context"):
        block(x)
    with routing_context(RoutingContext(input_ids=torch.tensor([[1, 2, 3]]))):
        block(x)  # given by hand
    with routing_context(RoutingContext(input_ids=torch.tensor([[1, 2]]))), \
            pytest.raises(ValueError, match="2 entries for 3 hidden rows"):
        block(x)


def test_models_without_a_context_router_are_not_hooked(hash_router):
    model = zoo.convert(tiny_native("mixtral"))
    assert not model._forward_pre_hooks
    zoo.apply(model, "test-hash")
    assert len(model._forward_pre_hooks) == 1
    zoo.apply(model, "topk-softmax", top_k=2)  # back to a router that ignores the context: hooks removed
    assert not model._forward_pre_hooks


def test_vision_language_context_tags_image_tokens():
    from zoo.moe.context import from_call

    model = type("M", (), {"config": type("C", (), {"image_token_id": 9})()})()
    ids = torch.tensor([[1, 9, 9, 4]])
    context = from_call(model, input_ids=ids)
    assert context.modality.tolist() == [[TEXT, VISION, VISION, TEXT]]


def test_calibrated_compression_publishes_the_context_layer_by_layer(hash_router):
    """prune-reap runs each layer on its calibration inputs (zoo.editing.layerwise): the hash router still sees the
    calibration batch's token ids there, so the experts it keeps are the ones those tokens hash to."""
    model = zoo.apply(tiny_native("mixtral"), "test-hash")
    ids = torch.tensor([[1, 5, 1, 5, 1, 5, 2, 1]])  # 1 -> 3, 5 -> 3, 2 -> 2 (x * 7 % 4)
    zoo.apply(model, "prune-reap", calibration=[ids], num_experts=2)
    kept = model.config.zoo_recipe[-1]["results"]["kept"]
    assert all(sorted(k) == [2, 3] for k in kept.values()), kept


def test_statistics_taken_in_chunks_route_each_chunk_in_its_own_context(hash_router):
    """Layer statistics route a layer's calibration tokens in chunks: each chunk's router call gets the context of its
    own rows (the whole call's would not line up with them)."""
    from zoo.editing.stats import layer_stats

    moe = moe_layers(zoo.apply(tiny_native("mixtral"), "test-hash"))[0][1]
    x = torch.randn(8, moe.router.hidden_size, generator=torch.Generator().manual_seed(0))
    with routing_context(RoutingContext(input_ids=torch.tensor([[1, 5, 1, 5, 1, 5, 2, 1]]))):
        stats = layer_stats(0, moe, x, chunk=3)
    assert stats.counts.tolist() == [0, 0, 1, 7]  # 1 -> 3, 5 -> 3, 2 -> 2 (x * 7 % 4)
