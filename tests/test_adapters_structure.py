"""Structure adapters: upcycle and moefy (a dense decoder -> the zoo model of its MoE sibling: Llama/Mistral ->
Mixtral, Qwen2 -> Qwen2-MoE, Qwen3 -> Qwen3-MoE, OLMo 2 -> FlexOlmo) and ewa (random uniform partition routing,
expert averaging, collapse), each against a naive reference."""
import pytest
import torch
import torch.nn.functional as F
from tiny import COMMON, padded_batch, reload_max_diff, tiny_native
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

import zoo
from zoo.moe.layout import moe_layers

IDS, MASK = padded_batch()
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_dense(seed=0):
    torch.manual_seed(seed)
    return MistralForCausalLM(MistralConfig(**COMMON, intermediate_size=96, num_hidden_layers=2, head_dim=16,
                                            tie_word_embeddings=True)).eval()


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS, attention_mask=MASK).logits


def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def swiglu(x, gate_up, down):
    gate, up = gate_up.chunk(2, dim=0)
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


@pytest.mark.parametrize("name, options", [
    ("upcycle", {"num_experts": 4, "top_k": 2}),
    ("upcycle", {"num_experts": 3, "top_k": 1}),
    ("upcycle", {"num_experts": 4, "top_k": 2, "gate": "hidden", "prompts": [[5, 6, 7], [9, 10], [[3, 4], [8]], [60]]}),
    ("moefy", {"num_experts": 4}),
    ("moefy", {"num_experts": 8, "top_k": 2}),
    ("moefy", {"num_experts": 3, "top_k": 1}),
    ("moefy", {"num_experts": 3, "top_k": None, "init": "split"}),
])
def test_dense_to_moe_reproduces_the_dense_model(name, options):
    dense = tiny_dense()
    before, ref = snapshot(dense), logits(dense)
    moe = zoo.apply(dense, name, **options)
    assert type(moe).__name__ == "ZooMixtralForCausalLM" and moe.config.model_type == "zoo_mixtral"
    assert [m.num_experts for _, m in moe_layers(moe)] == [options["num_experts"]] * 2
    assert (logits(moe) - ref).abs().max() < 1e-5
    assert same(before, dense.state_dict())  # the dense model is left as it was (copies, not shared tensors)
    shared = [k for k in before if ".mlp." not in k]
    assert all(torch.equal(moe.state_dict()[k], before[k]) for k in shared)
    assert moe.config.zoo_recipe[-1]["name"] == name and moe.config.zoo_recipe[-1]["results"]


def test_upcycle_copies_the_ffn_into_every_expert_and_hidden_rows_are_unit():
    dense = tiny_dense()
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14]]
    moe = zoo.apply(dense, "upcycle", num_experts=3, top_k=2, gate="hidden", prompts=prompts)
    for (_, block), layer in zip(moe_layers(moe), dense.model.layers):
        mlp = layer.mlp
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        assert all(torch.equal(block.experts.gate_up_proj[e], gate_up) for e in range(3))
        assert all(torch.equal(block.experts.down_proj[e], mlp.down_proj.weight) for e in range(3))
    # naive reference: mean post-attention-norm output per expert's prompts, minus the mean row, unit norm
    means = []
    for p in prompts:
        seen = []
        hooks = [layer.post_attention_layernorm.register_forward_hook(lambda m, a, out, seen=seen: seen.append(out[0].mean(0)))
                 for layer in dense.model.layers]
        with torch.no_grad():
            dense(input_ids=torch.tensor([p]))
        for h in hooks:
            h.remove()
        means.append(torch.stack(seen))  # [L, H]
    rows = torch.stack(means, 1)
    rows = rows - rows.mean(1, keepdim=True)
    rows = rows / rows.norm(dim=-1, keepdim=True)
    for (i, block) in moe_layers(moe):
        assert torch.allclose(block.router.weight, rows[i], atol=1e-5)
    noisy = zoo.apply(tiny_dense(), "upcycle", num_experts=2, top_k=2, noise=0.01)
    ex = moe_layers(noisy)[0][1].experts
    assert not torch.equal(ex.gate_up_proj[0], ex.gate_up_proj[1])


def test_moefy_split_experts_are_channel_slices_that_sum_to_the_ffn():
    dense = tiny_dense()
    moe = zoo.apply(dense, "moefy", num_experts=4, top_k=2, init="split")
    block, mlp = moe_layers(moe)[0][1], dense.model.layers[0].mlp
    assert block.top_k == 2 and block.experts.intermediate_size == 24
    x = torch.randn(5, 64)
    parts = sum(block.experts.expert(e, x) for e in range(4)) / 4  # down_proj carries a factor E
    assert torch.allclose(parts, mlp(x), atol=1e-6)


def test_moefy_grouped_is_lossless_with_top_k_below_num_experts_and_split_is_not():
    """The paper's allocation: E/k copies of a k-way split, one tied router row per copy, so the top-k is always
    one whole copy of the FFN. The old split (E slices) with top-k < E is not the dense model at init."""
    dense = tiny_dense()
    ref = logits(dense)
    moe = zoo.apply(dense, "moefy", num_experts=8, top_k=2)
    block, mlp = moe_layers(moe)[0][1], dense.model.layers[0].mlp
    assert block.experts.intermediate_size == 48 and moe.config.zoo_recipe[-1]["results"]["groups"] == 4
    w = block.router.weight
    assert all(torch.equal(w[2 * g], w[2 * g + 1]) for g in range(4)) and not torch.equal(w[0], w[2])
    x = torch.randn(7, 64)
    naive = sum(block.experts.expert(e, x) for e in range(2)) / 2  # one group, weights 1/2 each
    assert torch.allclose(naive, mlp(x), atol=1e-6)
    with torch.no_grad():
        routing = block.route(x)
    assert ((routing.indices // 2)[:, 0] == (routing.indices // 2)[:, 1]).all()  # both picks from one group
    assert (logits(moe) - ref).abs().max() < 1e-5
    old = zoo.apply(tiny_dense(), "moefy", num_experts=8, top_k=2, init="split")
    assert (logits(old) - ref).abs().max() > 1e-2  # the failure the grouped init fixes


DENSE_FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "olmo2"]
SIBLING = {"llama": "mixtral", "mistral": "mixtral", "qwen2": "qwen2_moe", "qwen3": "qwen3_moe", "olmo2": "flex_olmo"}


def tiny_dense_of(family: str, seed: int = 0):
    """A tiny random dense decoder of ``family`` with non-trivial norms and biases."""
    import transformers

    names = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "olmo2": "Olmo2", "olmo": "Olmo"}
    config = getattr(transformers, names[family] + "Config")(**COMMON, intermediate_size=96, num_hidden_layers=2,
                                                             **({"head_dim": 16} if family == "qwen3" else {}))
    torch.manual_seed(seed)
    model = getattr(transformers, names[family] + "ForCausalLM")(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or "bias" in n:
                p.normal_(1.0 if "norm" in n else 0.0, 0.3)
    return model


@pytest.mark.parametrize("family", DENSE_FAMILIES)
@pytest.mark.parametrize("name, options", [("upcycle", {"num_experts": 4, "top_k": 2}),
                                           ("upcycle", {"num_experts": 4, "top_k": 2, "gate": "hidden",
                                                        "prompts": [[5, 6], [7], [8, 9], [10]]}),
                                           ("moefy", {"num_experts": 4, "top_k": 2}),
                                           ("moefy", {"num_experts": 4, "top_k": None, "init": "split"})])
def test_every_dense_family_becomes_its_moe_sibling_with_the_dense_logits(family, name, options, tmp_path):
    dense = tiny_dense_of(family)
    before, ref = snapshot(dense), logits(dense)
    moe = zoo.apply(dense, name, **options)
    assert moe.config.model_type == "zoo_" + SIBLING[family]
    assert [m.num_experts for _, m in moe_layers(moe)] == [4, 4]
    assert all(m.shared_experts is None for _, m in moe_layers(moe))
    assert (logits(moe) - ref).abs().max() < 1e-5
    assert same(before, dense.state_dict())
    assert all(torch.equal(moe.state_dict()[k], before[k]) for k in before if ".mlp." not in k)
    assert reload_max_diff(moe, IDS, tmp_path / "m") < 1e-6


def test_olmo_1_is_refused_with_the_reason():
    dense = tiny_dense_of("olmo")
    before = snapshot(dense)
    with pytest.raises(TypeError, match="OLMo 1 uses parameter-free LayerNorm"):
        zoo.apply(dense, "upcycle")
    assert same(before, dense.state_dict())


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_ewa_collapse_is_the_plain_average(family):
    model = zoo.convert(tiny_native(family))
    old = [(i, m.experts.gate_up_proj.clone(), m.experts.down_proj.clone(), m.shared_experts)
           for i, m in moe_layers(model)]
    zoo.apply(model, "ewa", collapse=True)
    layers = moe_layers(model)
    assert [(m.num_experts, m.top_k) for _, m in layers] == [(1, 1)] * len(old)
    x = torch.randn(6, model.config.hidden_size)
    for (i, block), (j, gate_up, down, shared) in zip(layers, old):
        assert i == j and block.shared_experts is shared
        assert torch.allclose(block.experts.gate_up_proj[0], gate_up.mean(0), atol=1e-6)
        assert torch.allclose(block.experts.down_proj[0], down.mean(0), atol=1e-6)
        naive = swiglu(x, gate_up.mean(0), down.mean(0))
        if family == "mixtral":  # a one-expert softmax router gives weight 1: the block is the averaged FFN
            with torch.no_grad():
                assert torch.allclose(block(x[None])[0], naive, atol=1e-5)


def test_ewa_train_step_and_optimizer_hook_match_the_naive_formula():
    # imported after `import zoo`: importing the plugin package first would load it half-initialised
    from zoo_adapters.ewa import Ewa

    model = zoo.convert(tiny_native("mixtral"))
    zoo.apply(model, "ewa", beta=0.25)
    ewa = Ewa.from_model(model)
    ewa.routing = "router"  # the averaging alone, against the formula
    assert ewa.beta == 0.25 and not ewa.collapse
    ex = moe_layers(model)[0][1].experts
    w = ex.down_proj.detach().clone()
    ewa.train_step(model)
    assert torch.allclose(ex.down_proj, 0.75 * w + 0.25 * w.mean(0, keepdim=True), atol=1e-7)

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = ewa.register(opt, model)
    model(input_ids=IDS, attention_mask=MASK, labels=IDS).loss.backward()
    stepped = ex.gate_up_proj.detach() - 0.1 * ex.gate_up_proj.grad  # plain SGD, then the averaging
    opt.step()
    assert torch.allclose(ex.gate_up_proj, 0.75 * stepped + 0.25 * stepped.mean(0, keepdim=True), atol=1e-6)
    handle.remove()
    w = ex.gate_up_proj.detach().clone()
    opt.step()  # the hook is gone: only SGD
    assert torch.allclose(ex.gate_up_proj, w - 0.1 * ex.gate_up_proj.grad, atol=1e-7)


def test_ewa_partition_routing_is_a_random_uniform_partition_and_the_block_matches_a_naive_loop():
    from zoo_adapters.ewa import Ewa, partition_routing

    r = partition_routing(10, 4, torch.Generator().manual_seed(0))
    assert r.indices.shape == (10, 1) and torch.equal(r.weights, torch.ones(10, 1))
    assert sorted(torch.bincount(r.indices[:, 0], minlength=4).tolist()) == [2, 2, 3, 3]  # equal within one
    again = partition_routing(10, 4, torch.Generator().manual_seed(1))
    assert not torch.equal(r.indices, again.indices)  # random, not a fixed table

    model = zoo.convert(tiny_native("mixtral"))
    zoo.apply(model, "ewa", beta=0.5)
    ewa = Ewa.from_model(model)
    assert ewa.routing == "random-partition"  # the paper's routing is the default
    handle = ewa.route_by_partition(model)
    block = moe_layers(model)[0][1]
    x = torch.randn(1, 9, 64)
    seen = []
    h2 = block.router.register_forward_hook(lambda m, a, out: seen.append(out))
    block.train()
    with torch.no_grad():
        out = block(x)
    routing = seen[-1]
    counts = torch.bincount(routing.indices[:, 0], minlength=4)
    assert routing.indices.shape == (9, 1) and counts.max() - counts.min() <= 1
    naive = torch.stack([swiglu(x[0, t], block.experts.gate_up_proj[e], block.experts.down_proj[e])
                         for t, e in enumerate(routing.indices[:, 0].tolist())])
    assert torch.allclose(out[0], naive, atol=1e-5)
    block.eval()
    with torch.no_grad():
        block(x)
    assert seen[-1].indices.shape == (9, 2)  # eval mode: the model's own top-2 router
    handle.remove()
    h2.remove()
    block.train()
    with torch.no_grad():
        block(x)
    assert block.router(x[0]).indices.shape == (9, 2)


def test_ewa_register_trains_with_partition_routing_and_averaging():
    from zoo_adapters.ewa import Ewa

    model = zoo.convert(tiny_native("mixtral"))
    zoo.apply(model, "ewa", beta=0.25)
    ewa = Ewa.from_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = ewa.register(opt, model)
    model.train()
    router = moe_layers(model)[0][1].router
    w0 = router.weight.detach().clone()
    out = model(input_ids=IDS, attention_mask=MASK, labels=IDS, output_router_logits=True)
    out.loss.backward()
    assert router.weight.grad is None or router.weight.grad.abs().max() == 0  # no router decides
    opt.step()
    assert torch.equal(router.weight, w0)
    handle.remove()
    old = Ewa(beta=0.25, routing="router")
    assert len(old.register(opt, model).handles) == 1  # the zoo's variant: averaging only


@pytest.mark.parametrize("name, options, error, message", [
    ("upcycle", {"num_experts": 4, "top_k": 5}, ValueError, "top_k must be"),
    ("upcycle", {"num_experts": 0}, ValueError, "num_experts must be"),
    ("upcycle", {"gate": "hiden"}, ValueError, "gate must be one of"),
    ("upcycle", {"noise": -0.1}, ValueError, "noise must be"),
    ("upcycle", {"prompts": ["a"] * 8}, ValueError, "only used by gate='hidden'"),
    ("upcycle", {"gate": "hidden", "prompts": ["a", "b"]}, ValueError, "one per expert"),
    ("upcycle", {"num_expert": 4}, ValueError, "did you mean 'num_experts'"),
    ("upcycle", {"num_experts": 2, "gate": "hidden", "prompts": [[5], [500]]}, ValueError, "token ids in"),
    ("moefy", {"num_experts": 5}, ValueError, "must divide"),
    ("moefy", {"num_experts": 5, "top_k": None, "init": "split"}, ValueError, "must divide"),
    ("moefy", {"num_experts": 4, "top_k": 0}, ValueError, "top_k must be"),
    ("moefy", {"init": "slices"}, ValueError, "init must be one of"),
    ("ewa", {"beta": 1.5}, ValueError, "beta must be"),
    ("ewa", {"collapse": "yes"}, ValueError, "collapse.* must be"),
    ("ewa", {"routing": "hash"}, ValueError, "routing must be one of"),
    ("ewa", {}, TypeError, "not a supported MoE family"),
])
def test_bad_options_leave_the_model_unchanged(name, options, error, message):
    dense = tiny_dense()
    before = snapshot(dense)
    with pytest.raises(error, match=message):
        zoo.apply(dense, name, **options)
    assert same(before, dense.state_dict()) and type(dense) is MistralForCausalLM
    assert getattr(dense.config, "zoo_recipe", None) is None


def test_upcycle_refuses_an_moe_model():
    model = zoo.convert(tiny_native("mixtral"))
    before = snapshot(model)
    with pytest.raises(TypeError, match="needs a dense decoder of a family with an MoE sibling"):
        zoo.apply(model, "upcycle")
    assert same(before, model.state_dict()) and model.config.zoo_recipe == []


@pytest.mark.parametrize("steps", [
    [("upcycle", {"num_experts": 4, "top_k": 2, "noise": 0.01})],
    [("moefy", {"num_experts": 4, "top_k": 2})],
    [("upcycle", {"num_experts": 4, "top_k": 2}), ("ewa", {"beta": 0.5}), ("ewa", {"collapse": True})],
])
def test_save_reload_and_export_keep_logits_and_recipe(steps, tmp_path):
    model = tiny_dense()
    for name, options in steps:
        model = zoo.apply(model, name, **options)
    assert reload_max_diff(model, IDS, tmp_path / "zoo") < 1e-6
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "zoo")
    assert [s["name"] for s in loaded.config.zoo_recipe] == [name for name, _ in steps]
    assert loaded.config.zoo_recipe == model.config.zoo_recipe
    zoo.export(model, tmp_path / "native")
    native = AutoModelForCausalLM.from_pretrained(tmp_path / "native").eval()
    assert type(native).__name__ == "MixtralForCausalLM"
    assert (logits(native) - logits(model)).abs().max() < 1e-5


def test_upcycled_model_trains_and_its_experts_drift_apart():
    model = zoo.apply(tiny_dense(), "upcycle", num_experts=4, top_k=2)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(8):
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
        assert out.aux_loss is not None
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
    ex = moe_layers(model)[0][1].experts
    assert not torch.equal(ex.gate_up_proj[0], ex.gate_up_proj[1])


def test_check_component_end_to_end_for_the_new_options():
    """moefy's grouped init, ewa's routing option and moe-svd's paper sensitivity through zoo.testing's full check
    (bad options, apply, recipe, save, reload in a fresh process, card)."""
    from zoo.testing import check_components

    reports = check_components([("moefy", {"num_experts": 4, "top_k": 2}),
                                ("ewa", {"beta": 0.2, "routing": "random-partition"}),
                                ("moe-svd", {"ratio": 0.75, "sensitivity": "paper"})], families=["mistral", "mixtral"])
    assert [r["name"] for r in reports] == ["moefy", "ewa", "moe-svd"]
    assert all(r["families"] for r in reports)
