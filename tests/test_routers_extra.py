"""expert-choice, top-p and steer routers against loop references; empty slots in the experts; zoo.apply
validation, per-layer options, save/reload; top-p under torch.compile; zoo_routers.steer_experts.find_experts."""
# zoo is imported before zoo_routers on purpose: importing a plugin first would register it half-initialised.
import copy  # noqa: I001
import json

import pytest
import torch

import zoo
from zoo.moe.layout import build_block, moe_layers
from zoo.moe import SparseMoE, SwiGLUExperts
from zoo.moe.routing import Routing
from zoo_routers.steer_experts import activation_rates, find_experts
from zoo_routers.expert_choice import ExpertChoice
from zoo_routers.sigmoid_bias import SigmoidBias
from zoo_routers.steer import Steer
from zoo_routers.top_p import TopP
from zoo_routers.topk_softmax import TopKSoftmax
from tiny import reload_max_diff, tiny_native

H = 12
pytestmark = pytest.mark.usefixtures("one_thread")


def spread_(router, std=0.5):
    with torch.no_grad():
        router.weight.normal_(0.0, std)
    return router


def as_dicts(routing, num_experts):
    """Per token ``{expert: weight}`` over the real (non-empty) slots, checking that no expert repeats."""
    out = []
    for w_row, i_row in zip(routing.weights.tolist(), routing.indices.tolist()):
        real = [(e, w) for e, w in zip(i_row, w_row) if e != num_experts]
        assert len({e for e, _ in real}) == len(real)
        out.append(dict(real))
    return out


def assert_same_routing(got: list[dict], want: list[dict]):
    assert [sorted(d) for d in got] == [sorted(d) for d in want]
    for g, w in zip(got, want):
        for e in w:
            assert g[e] == pytest.approx(w[e], rel=1e-5, abs=1e-6)


def probs_of(router, x):
    return torch.softmax(x @ router.weight.T, dim=-1)


# ----------------------------------------------------------------------------------------- expert-choice

def ref_expert_choice(probs, capacity_factor):
    tokens, num_experts = probs.shape
    c = min(tokens, max(1, -(-tokens * capacity_factor // num_experts)))
    out = [{} for _ in range(tokens)]
    for e in range(num_experts):
        for t in sorted(range(tokens), key=lambda t: -probs[t, e].item())[:int(c)]:
            out[t][e] = probs[t, e].item()
    return out, int(c)


@pytest.mark.parametrize("tokens,num_experts,factor", [(24, 8, 2), (24, 8, 0.5), (7, 4, 1.5), (5, 4, 10), (1, 8, 2)])
def test_expert_choice_matches_reference(tokens, num_experts, factor):
    torch.manual_seed(tokens + num_experts)
    router = spread_(ExpertChoice(H, num_experts, 2, capacity_factor=factor))
    x = torch.randn(tokens, H)
    routing = router(x)
    assert routing.weights.shape == routing.indices.shape == (tokens, num_experts)
    want, c = ref_expert_choice(probs_of(router, x), factor)
    got = as_dicts(routing, num_experts)
    assert_same_routing(got, want)
    per_expert = torch.bincount(routing.indices.flatten(), minlength=num_experts + 1)[:num_experts]
    assert (per_expert == c).all()  # perfectly balanced by construction
    assert router.capacity(tokens) == c


def test_expert_choice_tokens_get_zero_to_all_experts_and_default_factor_is_k():
    torch.manual_seed(0)
    router = spread_(ExpertChoice(H, 8, 1), std=2.0)
    assert router.capacity_factor == 1.0 and router.options == {"bias": False, "capacity_factor": None}
    counts = (router(torch.randn(64, H)).indices < 8).sum(-1)
    assert counts.float().mean() == 1.0  # E * c / T experts per token on average
    assert counts.min() == 0 and counts.max() > 1


def test_expert_choice_gradient_reaches_the_gate():
    torch.manual_seed(1)
    router = spread_(ExpertChoice(H, 4, 2, capacity_factor=1.0))
    x = torch.randn(10, H)
    routing = router(x)
    chosen = routing.indices < 4
    probs = torch.softmax(x @ router.weight.T, -1)
    ref = torch.where(chosen, probs.gather(1, routing.indices.clamp(max=3)), 0.0)
    g = torch.randn(10, 4)
    got = torch.autograd.grad((routing.weights * g).sum(), router.weight)[0]
    want = torch.autograd.grad((ref * g).sum(), router.weight)[0]
    torch.testing.assert_close(got, want)
    assert got.abs().sum() > 0


# ----------------------------------------------------------------------------------------------- top-p

def ref_top_p(probs, p, max_k):
    out = []
    for row in probs.tolist():
        kept, mass = {}, 0.0
        for e in sorted(range(len(row)), key=lambda e: -row[e]):
            if mass >= p or len(kept) == max_k:
                break
            kept[e] = row[e]
            mass += row[e]
        total = sum(kept.values())
        out.append({e: w / total for e, w in kept.items()})
    return out


@pytest.mark.parametrize("p,max_k", [(0.5, None), (0.9, None), (0.9, 2), (1.0, 3), (0.01, None)])
def test_top_p_matches_reference(p, max_k):
    torch.manual_seed(int(p * 100))
    router = spread_(TopP(H, 8, 2, p=p, max_k=max_k), std=1.0)
    x = torch.randn(40, H, requires_grad=True)
    routing = router(x)
    assert routing.weights.shape == routing.indices.shape == (40, max_k or 8)
    probs = probs_of(router, x)
    assert_same_routing(as_dicts(routing, 8), ref_top_p(probs.detach(), p, max_k or 8))
    assert (routing.indices[:, 0] < 8).all()  # the most probable expert is always kept
    torch.testing.assert_close(routing.weights.sum(-1), torch.ones(40))
    n = (routing.indices < 8).sum(-1)
    if p == 0.01:
        assert (n == 1).all()
    elif max_k is None:
        assert n.min() < n.max()  # a dynamic number of experts per token

    # gradients through the renormalised kept probabilities, against a reference built from the mask
    keep = routing.indices < 8
    kept = torch.where(keep, probs.gather(1, routing.indices.clamp(max=7)), 0.0)
    ref = kept / kept.sum(-1, keepdim=True)
    g = torch.randn_like(ref)
    got = torch.autograd.grad((routing.weights * g).sum(), [x, router.weight])
    want = torch.autograd.grad((ref * g).sum(), [x, router.weight])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_top_p_dynamic_loss_is_the_routing_entropy():
    torch.manual_seed(3)
    router = spread_(TopP(H, 8, 2, p=0.5, dynamic_loss_coef=0.01), std=1.0)
    x = torch.randn(30, H)
    router.train()
    router(x)
    probs = probs_of(router, x)
    entropy = -(probs * probs.log()).sum(-1).mean()
    torch.testing.assert_close(router.train_loss(), 0.01 * entropy)
    (grad,) = torch.autograd.grad(router.train_loss(), [router.weight])
    assert grad.abs().sum() > 0 and router.trainable_parameters() == [router.weight]
    router.eval()
    router(x)
    assert router.train_loss() is None  # evaluation adds no loss
    with pytest.raises(ValueError, match="dynamic_loss_coef"):
        TopP(H, 8, 2, dynamic_loss_coef=-1.0)


def test_top_p_finetune_trains_only_the_gates_and_sharpens_them():
    """moe-zoo finetune with the dynamic loss (a large coefficient, so three steps show it): the gates move, the
    routing entropy and the experts per token go down, nothing else changes."""
    import copy

    import zoo
    from zoo.training.finetune import finetune
    from zoo.moe.layout import moe_layers

    base = zoo.load("zoo-tiny-moe", dtype=torch.float32)
    result = finetune(copy.deepcopy(base), "top-p", {"p": 0.7, "dynamic_loss_coef": 5.0}, domain="code", steps=3,
                      lr=0.02, batch_size=2, seq_len=32, windows=1, threads=1, bf16=False, progress=False)
    tuned = result.model.eval()
    assert result.trainable_params == len(moe_layers(base)) * base.config.num_local_experts * base.config.hidden_size
    before = zoo.apply(copy.deepcopy(base), "top-p", p=0.7).eval()
    base_state = base.state_dict()
    for name, value in tuned.state_dict().items():
        if not name.endswith("router.weight"):
            assert torch.equal(value, base_state[name]), name
    ids = torch.randint(0, base.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    stats = {}
    for label, model in (("before", before), ("after", tuned)):
        routers = [m.router for _, m in moe_layers(model)]
        seen = []
        hooks = [r.register_forward_hook(lambda mod, args, out: seen.append(((out.indices < 8).sum(-1).float().mean(),
                                                                             mod.gate_logits(args[0]))))
                 for r in routers]
        with torch.no_grad():
            model(input_ids=ids)
        for h in hooks:
            h.remove()
        probs = [torch.softmax(logits.float(), -1) for _, logits in seen]
        stats[label] = (torch.stack([k for k, _ in seen]).mean(),
                        torch.stack([-(q * q.log()).sum(-1).mean() for q in probs]).mean())
    assert stats["after"][1] < stats["before"][1] and stats["after"][0] < stats["before"][0], stats


def test_top_p_compiles_without_graph_breaks():
    torch.manual_seed(2)
    experts = SwiGLUExperts(8, H, 16)
    block = SparseMoE(spread_(TopP(H, 8, 2, p=0.7, max_k=4)), experts).eval()
    compiled = torch.compile(block, fullgraph=True, backend="eager")  # a graph break would raise
    for tokens in (1, 2):  # decode sizes: the gather path, with empty slots
        x = torch.randn(1, tokens, H)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), block(x))
    router = torch.compile(block.router, fullgraph=True, backend="eager")
    x = torch.randn(9, H)
    want = block.router(x)
    got = router(x)
    assert torch.equal(got.indices, want.indices)
    torch.testing.assert_close(got.weights, want.weights)


# ----------------------------------------------------------------------------------------------- steer

def ref_steer_softmax(probs, k, off, on, norm):
    out = []
    for row in probs.tolist():
        rest = sorted((e for e in range(len(row)) if e not in off and e not in on), key=lambda e: -row[e])
        chosen = list(on) + rest[:k - len(on)]
        total = sum(row[e] for e in chosen) if norm else 1.0
        out.append({e: row[e] / total for e in chosen})
    return out


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("off,on", [([], []), ([0, 3], []), ([], [5]), ([1, 2, 4], [6, 7]), ([7], [0])])
def test_steer_softmax_matches_reference(off, on, norm):
    torch.manual_seed(len(off) * 10 + len(on))
    router = spread_(Steer(H, 8, 3, disable={2: off}, force={"2": on}, layer=2, norm_topk_prob=norm))
    x = torch.randn(30, H)
    routing = router(x)
    assert routing.indices.shape == (30, 3)
    assert_same_routing(as_dicts(routing, 8), ref_steer_softmax(probs_of(router, x), 3, off, on, norm))
    # another layer's lists do not apply here
    other = Steer(H, 8, 3, disable={1: [0, 1, 2, 3]}, layer=2, norm_topk_prob=norm)
    other.load_state_dict(router.state_dict())
    base = TopKSoftmax(H, 8, 3, norm_topk_prob=norm)
    base.load_state_dict(router.state_dict())
    assert torch.equal(other(x).indices, base(x).indices)
    torch.testing.assert_close(other(x).weights, base(x).weights)


def ref_steer_sigmoid(logits, correction, k, n_group, topk_group, scale, off, on):
    """DeepSeek-V3 selection written out per token, with disabled experts removed and forced ones added."""
    num_experts = logits.shape[-1]
    size = num_experts // n_group
    out = []
    for row in logits:
        scores = torch.sigmoid(row).tolist()
        biased = [-float("inf") if e in off else s + c for e, (s, c) in enumerate(zip(scores, correction.tolist()))]
        groups = [list(range(g * size, (g + 1) * size)) for g in range(n_group)]
        rank = sorted(range(n_group), key=lambda g: -sum(sorted((biased[e] for e in groups[g]), reverse=True)[:2]))
        inside = [e for g in rank[:topk_group] for e in groups[g]]
        outside = [e for g in rank[topk_group:] for e in groups[g]]
        pool = [e for e in sorted(inside, key=lambda e: -biased[e]) + sorted(outside, key=lambda e: -biased[e])
                if e not in off and e not in on]
        chosen = list(on) + pool[:k - len(on)]
        total = sum(scores[e] for e in chosen)
        out.append({e: scores[e] / total * scale for e in chosen})
    return out


@pytest.mark.parametrize("off,on", [([], []), ([2, 3], [0]), ([0, 1, 2, 3, 4, 5], []), ([], [6, 7])])
def test_steer_sigmoid_base_matches_reference(off, on):
    torch.manual_seed(5)
    opts = {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}
    router = spread_(Steer(H, 8, 2, disable={0: off}, force={0: on}, layer=0, base="sigmoid-bias", **opts))
    router.e_score_correction_bias.normal_(0, 0.1)
    x = torch.randn(25, H)
    routing = router(x)
    want = ref_steer_sigmoid(x @ router.weight.T, router.e_score_correction_bias, 2, 4, 2, 2.5, off, on)
    assert_same_routing(as_dicts(routing, 8), want)
    if not off and not on:  # unsteered: exactly the sigmoid-bias router
        base = SigmoidBias(H, 8, 2, **opts)
        base.load_state_dict(router.state_dict())
        assert torch.equal(base(x).indices, routing.indices) and torch.equal(base(x).weights, routing.weights)


def test_steer_gradient_matches_the_base_router():
    torch.manual_seed(6)
    router = spread_(Steer(H, 8, 2, layer=0))
    base = TopKSoftmax(H, 8, 2)
    base.load_state_dict(router.state_dict())
    x = torch.randn(7, H)
    a, b = router(x), base(x)
    assert torch.equal(a.indices, b.indices)
    g = torch.randn(7, 2)
    torch.testing.assert_close(torch.autograd.grad((a.weights * g).sum(), router.weight)[0],
                               torch.autograd.grad((b.weights * g).sum(), base.weight)[0])


# ------------------------------------------------------------------------------- empty slots in experts

def naive_experts(experts, x, routing):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(routing.indices[t].tolist(), routing.weights[t]):
            if e < experts.num_experts:
                out[t] += w * experts.expert(e, x[t:t + 1])[0]
    return out


@pytest.mark.parametrize("router_cls,opts", [(ExpertChoice, {"capacity_factor": 1.0}), (TopP, {"p": 0.6})])
def test_experts_skip_empty_slots(router_cls, opts):
    torch.manual_seed(7)
    experts = SwiGLUExperts(6, H, 10)
    router = spread_(router_cls(H, 6, 2, **opts), std=1.5)
    x = torch.randn(9, H)
    routing = router(x)
    assert (routing.indices == 6).any()
    want = naive_experts(experts, x, routing)
    torch.testing.assert_close(experts._forward_sorted(x, routing), want)
    torch.testing.assert_close(experts._forward_gather(x, routing), want)
    # whatever an empty slot's weight is (even NaN), it is ignored; a token with no expert gets zeros
    nan = Routing(torch.where(routing.indices == 6, float("nan"), routing.weights), routing.indices)
    torch.testing.assert_close(experts._forward_sorted(x, nan), want)
    torch.testing.assert_close(experts._forward_gather(x, nan), want)
    none = Routing(torch.zeros(2, 3), torch.full((2, 3), 6))
    assert torch.equal(experts(x[:2], none), torch.zeros(2, H))


# -------------------------------------------------------------------------------- zoo.apply and models

def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name,options,message", [
    ("expert-choice", {"capacity_factor": 0}, "capacity_factor must be"),
    ("expert-choice", {"capacity_factor": "2"}, "capacity_factor.* must be float"),
    ("expert-choice", {"capacity_factr": 2}, "did you mean 'capacity_factor'"),
    ("top-p", {"p": 0}, "p must be"),
    ("top-p", {"p": 1.5}, "p must be"),
    ("top-p", {"max_k": 5}, r"max_k must be an integer in \[1, 4\]"),
    ("steer", {"disable": {1: [4]}}, r"expert ids must be in \[0, 4\)"),
    ("steer", {"disable": {0: [0, 1, 2]}}, "leaves fewer than top_k=2"),
    ("steer", {"force": {1: [0, 1, 2]}}, "do not fit in top_k=2"),
    ("steer", {"disable": {0: [1]}, "force": {0: [1]}}, "both disabled and forced"),
    ("steer", {"disable": [1, 2]}, "must be a mapping"),
    ("steer", {"disable": {"first": [1]}}, "maps a layer index"),
    ("steer", {"layer": 1}, "filled in by zoo.apply"),
    ("steer", {"n_group": 2}, "sigmoid-bias base only"),
])
def test_bad_options_leave_the_model_unchanged(name, options, message):
    model = zoo.convert(tiny_native("mixtral"))
    before, routers = snapshot(model), [m.router for _, m in moe_layers(model)]
    recipe, layout = list(model.config.zoo_recipe), copy.deepcopy(model.config.zoo_layout)
    with pytest.raises((ValueError, TypeError), match=message):
        zoo.apply(model, name, **options)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert [m.router for _, m in moe_layers(model)] == routers
    assert model.config.zoo_recipe == recipe and model.config.zoo_layout == layout


def test_steer_refuses_a_base_it_cannot_steer():
    model = zoo.apply(zoo.convert(tiny_native("mixtral")), "expert-choice")
    routers = [m.router for _, m in moe_layers(model)]
    with pytest.raises(ValueError, match="this layer's router is 'expert-choice'"):
        zoo.apply(model, "steer", disable={0: [1]})
    assert [m.router for _, m in moe_layers(model)] == routers


IDS = torch.tensor([[5, 17, 33, 9, 70, 11, 3, 44, 21, 100], [8, 21, 66, 12, 90, 4, 4, 71, 33, 2]])


@pytest.mark.parametrize("family,name,options", [
    ("mixtral", "expert-choice", {"capacity_factor": 1.5}),
    ("mixtral", "top-p", {"p": 0.7, "max_k": 3}),
    ("mixtral", "steer", {"disable": {0: [1]}, "force": {1: [2]}}),
    ("deepseek_v3", "steer", {"disable": {1: [0, 5]}, "force": {2: [7]}}),
])
def test_save_and_reload_give_identical_logits(family, name, options, tmp_path):
    model = zoo.convert(tiny_native(family))
    with torch.no_grad():
        base = model(input_ids=IDS).logits
    zoo.apply(model, name, **options)
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=IDS).logits, base)  # the router changed the function
    assert reload_max_diff(model, IDS, tmp_path) < 1e-5
    layout = json.loads((tmp_path / "config.json").read_text())["zoo_layout"]
    rebuilt = {i: build_block(e).router for i, e in enumerate(layout) if e}
    for i, moe in moe_layers(model):
        assert rebuilt[i].name == name
        if name == "steer":  # each layer knows its index, so only its own lists apply
            assert rebuilt[i].layer == i and rebuilt[i].disabled == moe.router.disabled == tuple(
                options["disable"].get(i, ()))
            assert rebuilt[i].forced == moe.router.forced == tuple(options["force"].get(i, ()))
            assert rebuilt[i].base == ("sigmoid-bias" if family == "deepseek_v3" else "topk-softmax")


def test_steer_takes_effect_only_in_its_layers():
    model = zoo.convert(tiny_native("qwen3_moe"))
    zoo.apply(model, "steer", disable={"1": [0, 1, 2]}, force={0: [3]})
    seen = {i: torch.zeros(8, dtype=torch.long) for i, _ in moe_layers(model)}

    def count(module, args, routing, i):
        seen[i] += torch.bincount(routing.indices.flatten(), minlength=8)

    for i, moe in moe_layers(model):
        moe.router.register_forward_hook(lambda m, a, r, i=i: count(m, a, r, i))
    with torch.no_grad():
        model(input_ids=IDS)
    assert seen[0][3] == IDS.numel() and seen[0][:3].sum() > 0  # forced in layer 0, free there otherwise
    assert seen[1][:3].sum() == 0 and seen[1][3] < IDS.numel()
    assert model.config.zoo_recipe[-1]["options"] == {"disable": {"1": [0, 1, 2]}, "force": {0: [3]}}


def test_find_experts_returns_experts_that_steer():
    model = zoo.convert(tiny_native("mixtral", seed=3))
    g = torch.Generator().manual_seed(0)
    set_a = [torch.randint(3, 40, (2, 16), generator=g) for _ in range(2)]  # two "behaviours": token ranges
    set_b = [torch.randint(80, 128, (2, 16), generator=g) for _ in range(2)]
    found = find_experts(model, set_a, set_b, top=3)
    assert found and sum(map(len, found.values())) <= 3
    assert set(found) <= {i for i, _ in moe_layers(model)}
    assert all(len(v) <= 4 - 2 for v in found.values())  # each layer keeps at least k experts
    rate_a, rate_b = activation_rates(model, set_a), activation_rates(model, set_b)
    assert all(rate_a[i][e] > rate_b[i][e] for i, es in found.items() for e in es)
    with torch.no_grad():
        before = [model(input_ids=ids).logits for ids in set_a]
    zoo.apply(model, "steer", disable=json.loads(json.dumps(found)))  # string keys, as from a JSON file
    steered = activation_rates(model, set_a)
    assert all(steered[i][e] == 0 for i, es in found.items() for e in es)
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=set_a[0]).logits, before[0])
