"""Doge and the product-key router: the router against Doge's own lines and a written-out reference (both splits),
refusals, pruning to a count that is no square (exact for the tokens whose picks remain), and the tiny Doge converted
losslessly, reloaded, exported back to its own layout, given Doge's balance loss and changed by the zoo's
components."""
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DogeConfig, DogeForCausalLM

import zoo
from tiny import greedy as greedy_of, logits as logits_of, rel
from tests.families.test_generic_families import native_model
from zoo.architectures.family import NotConvertible, NotExportable
from zoo.components.registry import registry
from zoo.moe import SparseMoE
from zoo.moe.experts import MLPExperts
from zoo.moe.layout import build_block, moe_layers
from zoo.moe.surgery import keep_experts, merge_experts

H, N = 16, 4  # E = N * N experts
IDS = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(1))
CAL = [torch.randint(3, 100, (4, 16), generator=torch.Generator().manual_seed(2))]


def router(split="tokens", k=3, num_experts=N * N, **options):
    torch.manual_seed(0)
    r = registry.get("router", "product-key").obj(H, num_experts, k, split=split, **options)
    with torch.no_grad():
        r.weight.normal_()
    return r


def doge_rule(x, weight, n, k, norm_topk_prob):
    """DogeCDMoE's routing lines as transformers 5.24 has them (x [T, H])."""
    router_logits = F.linear(x, weight).view(2, x.shape[0], -1)
    (scores_x, scores_y), (indices_x, indices_y) = router_logits.topk(n, dim=-1)
    all_scores = (scores_x.unsqueeze(-1) + scores_y.unsqueeze(-2)).flatten(-2)
    all_indices = (indices_x.unsqueeze(-1) * n + indices_y.unsqueeze(-2)).flatten(-2)
    scores, position_indices = all_scores.topk(k, dim=-1)
    weights = F.softmax(scores, dim=-1)
    if norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True)
    return all_indices.gather(-1, position_indices), weights


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("split", ["tokens", "halves"])
def test_routing_matches_doge_and_a_written_out_reference(split, norm):
    r = router(split, norm_topk_prob=norm)
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(3))  # odd: halves of tokens t // 2, (T + t) // 2
    got, want = r(x), r.reference(x)
    assert torch.equal(got.indices, want.indices) and got.logits.shape == (7, N * N)
    assert torch.allclose(got.weights, want.weights, rtol=1e-5, atol=1e-6)
    assert torch.allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    if split == "tokens":
        indices, weights = doge_rule(x, r.weight, N, 3, norm)
        assert torch.equal(got.indices, indices) and torch.allclose(got.weights, weights, rtol=1e-6, atol=1e-7)
    # halves: each token routes on its own logits; tokens: on other tokens' (a single token reads its own)
    prefix = r(x[:3])
    assert torch.equal(prefix.indices, got.indices[:3]) is (split == "halves")
    alone = registry.get("router", "product-key").obj(H, N * N, 3, split="halves", norm_topk_prob=norm)
    alone.load_state_dict(r.state_dict())
    assert torch.equal(r(x[:1]).indices, alone(x[:1]).indices)


def test_bad_options_are_refused_in_one_line():
    cls = registry.get("router", "product-key").obj
    for kwargs, match in (({"num_experts": 15}, r"15 experts need num_keys = sqrt of it \(got 3\), or expert_ids"),
                          ({"split": "rows"}, r"split must be one of \('halves', 'tokens'\), got 'rows'"),
                          ({"num_keys": 0}, "num_keys must be a positive integer"),
                          ({"num_experts": 3, "num_keys": 2, "expert_ids": [0, 0, 1]}, "3 distinct product ids"),
                          ({"num_experts": 2, "num_keys": 2, "expert_ids": [0, 4]}, r"in \[0, 4\)")):
        with pytest.raises(ValueError, match=match) as info:
            cls(H, **{"num_experts": N * N, "top_k": 2, **kwargs})
        assert "\n" not in str(info.value)
    assert "expert_ids" not in cls(H, 4, 2, num_keys=2, expert_ids=[0, 1, 2, 3]).options  # all pairs: the plain form


def block(split="tokens", n=N):
    moe = SparseMoE(router(split, num_experts=n * n), MLPExperts(n * n, H, 1, activation="silu"))
    with torch.no_grad():
        moe.experts.up_proj.normal_()
        moe.experts.down_proj.normal_()
    return moe


def test_pruning_keeps_the_gate_and_names_the_kept_product_ids():
    # The gate scores sub-keys each shared by n experts: pruning keeps it whole and the router scores the kept ids
    # alone (a count that is no square is fine). A token whose k picks all remain routes and computes as before;
    # the others pick the next best among those that remain, as a pruned top-k router does.
    moe = block()
    keep = [0, 2, 3, 5, 6, 7, 9, 10, 11, 12, 13, 15]
    pruned = keep_experts(moe, keep)
    assert pruned.num_experts == 12 and pruned.router.expert_ids == keep
    assert torch.equal(pruned.router.weight, moe.router.weight)
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(5))
    before, after = moe.route(x), pruned.route(x)
    # one-neuron experts run gathered (zoo.moe.experts.MLPExperts): pair by pair, as the written-out reference
    assert torch.allclose(moe.experts(x, before), moe.experts.reference(x, before), rtol=1e-5, atol=1e-5)
    untouched = torch.isin(before.indices, torch.tensor(keep)).all(-1)
    assert untouched.any() and not untouched.all()
    assert torch.equal(torch.tensor(keep)[after.indices[untouched]], before.indices[untouched])
    assert torch.allclose(pruned(x)[untouched], moe(x)[untouched], rtol=1e-5, atol=1e-6)
    again = build_block(pruned.layout())
    again.load_state_dict(pruned.state_dict())
    assert again.layout() == pruned.layout() and torch.equal(again(x), pruned(x))
    assert keep_experts(pruned, [0, 1, 5]).router.expert_ids == [0, 2, 7]  # ids compose
    small = block(n=2)  # 2n == E: the gate's 4 rows are still no expert rows
    assert torch.equal(keep_experts(small, [1, 3]).router.weight, small.router.weight)
    merged = merge_experts(moe, [list(range(8)), list(range(8, 16))], [[1.0] * 8] * 2)  # behind an expert map
    assert merged.num_experts == 2 and torch.isfinite(merged(x)).all()
    with pytest.raises(ValueError, match="'product-key' has no row per expert to cut"):
        merge_experts(moe, [list(range(8)), list(range(8, 16))], [[1.0] * 8] * 2, router_rows=lambda s, m: s)


# ---- the family ---------------------------------------------------------------------------------------------------
def native():
    """The tiny Doge (16 experts, top-2), its sub-key gate spread so that many experts are picked."""
    model = native_model("doge")
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.router_gate.weight.normal_(generator=gen)
    return model


def logits(model, ids=IDS):
    return logits_of(model, ids)


def test_blocks_it_cannot_hold_are_refused():
    family = registry.get("architecture", "doge").obj
    base = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                num_hidden_layers=1, is_moe=True, num_experts_per_tok=2)
    entry = family.block_layout(DogeConfig(**base, num_experts=9, norm_topk_prob=True))
    assert entry["router_options"] == {"bias": False, "num_keys": 3, "split": "tokens", "norm_topk_prob": True}
    with pytest.raises(NotConvertible, match="num_experts=15: not a square, so experts 9.. are never routed to"):
        family.block_layout(DogeConfig(**base, num_experts=15))
    with pytest.raises(NotConvertible, match="mlp_bias"):
        family.block_layout(DogeConfig(**base, num_experts=9, mlp_bias=True))


def test_converts_losslessly_reloads_and_exports_its_own_layout(tmp_path):
    model = native()
    want, want_tokens, want_state = logits(model), greedy_of(model, IDS, 4), dict(model.state_dict())
    model = zoo.convert(model)
    entry = model.config.zoo_layout[0]
    assert (entry["router"], entry["router_options"]["split"], entry["experts"]) == ("product-key", "tokens", "mlp")
    assert entry["experts_options"]["intermediate_size"] == 1 and entry["shared_experts"]["intermediate_size"] == 64
    assert rel(logits(model), want) <= 1e-5
    assert torch.equal(greedy_of(model, IDS, 4), want_tokens)

    model.save_pretrained(tmp_path / "zoo")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "zoo").eval()
    assert type(back) is type(model) and back.config.zoo_layout == model.config.zoo_layout
    assert rel(logits(back), want) <= 1e-5

    zoo.export(back, tmp_path / "native")
    again = DogeForCausalLM.from_pretrained(tmp_path / "native").eval()
    state = again.state_dict()
    assert state.keys() == want_state.keys() and all(torch.equal(state[k], v) for k, v in want_state.items())
    assert rel(logits(again), want) <= 1e-5


def test_balance_loss_is_doges_own(one_thread):
    model = native()
    mask = torch.ones_like(IDS)
    mask[1, 7:] = 0
    for attention_mask in (None, mask):
        with torch.no_grad():
            want = model(input_ids=IDS, attention_mask=attention_mask, labels=IDS, output_router_logits=True)
        want_aux, want_loss = want.aux_loss, want.loss
        assert want_aux is not None
        zoo_model = zoo.convert(native()) if attention_mask is None else zoo_model
        with torch.no_grad():
            got = zoo_model(input_ids=IDS, attention_mask=attention_mask, labels=IDS, output_router_logits=True)
        assert torch.allclose(got.aux_loss, want_aux, rtol=1e-5) and torch.allclose(got.loss, want_loss, rtol=1e-5)
        assert got.router_logits[0].shape == (IDS.numel(), 16)


def test_zoo_components_change_it_and_it_reloads(tmp_path, one_thread):
    model = zoo.convert(native())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"16 experts need num_keys = sqrt of it \(got 3\)"):
        zoo.apply(model, "product-key", num_keys=3)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

    zoo.apply(model, "prune-frequency", calibration=CAL, num_experts=12)
    assert all(moe.num_experts == 12 and len(moe.router.expert_ids) == 12 for _, moe in moe_layers(model))
    pruned = logits(model)
    with pytest.raises(NotExportable, match="pruned to 12 of the 16 product-key pairs"):
        zoo.export(model, tmp_path / "pruned")

    gate = moe_layers(model)[0][1].router.weight.clone()
    zoo.apply(model, "product-key", split="halves")  # the papers' per-token rule on the same gate
    assert torch.equal(moe_layers(model)[0][1].router.weight, gate)
    causal = logits(model)
    assert rel(causal, pruned) > 1e-3  # the split changed the routing
    assert rel(logits(model, IDS[:, :6]), causal[:, :6]) <= 1e-5  # a prefix routes as it does in the whole

    zoo.apply(model, "expert-choice")
    zoo.apply(model, "quantize", bits=8, group_size=32)
    assert all(moe.router.name == "expert-choice" and moe.experts.name == "quantized-mlp"
               for _, moe in moe_layers(model))
    out = logits(model)
    assert torch.isfinite(out).all()
    model.save_pretrained(tmp_path / "changed")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "changed").eval()
    assert [s["name"] for s in back.config.zoo_recipe] == ["prune-frequency", "product-key", "expert-choice",
                                                             "quantize"]
    assert rel(logits(back), out) <= 1e-5
