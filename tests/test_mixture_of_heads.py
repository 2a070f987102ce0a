"""mixture-of-heads: gates and the mixed attention against per-token / per-head loop references (outputs and router
gradients), exactness with all heads, heads per token, save/reload, rejected options, KV-cache decoding, tuning."""
# zoo is imported before zoo_routers on purpose: importing a plugin first would register it half-initialised.
import pytest  # noqa: I001
import torch
from transformers import AutoModelForCausalLM

import zoo
from zoo_routers.mixture_of_heads import MixedHeadsAttention, MixtureOfHeads, head_balance_loss
from tiny import padded_batch, reload_max_diff, tiny_native

IDS, MASK = padded_batch()
pytestmark = pytest.mark.usefixtures("one_thread")


def spread_(model_or_router, std=0.5, seed=0):
    """Random router weights (a zero router ties every logit)."""
    torch.manual_seed(seed)
    routers = [model_or_router] if isinstance(model_or_router, MixtureOfHeads) else \
        [m for m in model_or_router.modules() if isinstance(m, MixtureOfHeads)]
    with torch.no_grad():
        for r in routers:
            for p in r.parameters():
                p.normal_(0, std)
    return model_or_router


def ref_gates(router, x):
    """Per token, by hand: shared softmax x h_s, routed top-k by sorting, softmax over the kept x k, group weights x 2."""
    rows = []
    for xt in x:
        hs, hr, k = router.num_shared, router.num_routed, router.top_k
        shared = (torch.softmax(router.shared_gate.weight @ xt, 0) * hs if hs > 1 else torch.ones(hs))
        routed = torch.zeros(hr)
        if hr:
            logits = router.routed_gate.weight @ xt
            keep = sorted(range(hr), key=lambda h: -logits[h].item())[:k]
            kept = torch.softmax(logits[keep], 0) * k
            routed = torch.stack([kept[keep.index(h)] if h in keep else torch.zeros(()) for h in range(hr)])
        if hs and hr:
            a = torch.softmax(router.group_gate.weight @ xt, 0) * 2
            shared, routed = shared * a[0], routed * a[1]
        rows.append(torch.cat([shared, routed]))
    return torch.stack(rows)


@pytest.mark.parametrize("heads, active, shared", [(8, 5, 2), (8, 4, 0), (8, 3, 1), (6, 6, 3), (4, 4, 4), (5, 1, 0)])
def test_gates_and_their_gradients_match_a_per_token_reference(heads, active, shared):
    torch.manual_seed(heads * 10 + active)
    router = spread_(MixtureOfHeads(12, heads, heads_per_token=active, shared_heads=shared), std=1.0)
    x = torch.randn(20, 12)
    got, want = router(x).gates, ref_gates(router, x)
    torch.testing.assert_close(got, want)
    assert ((got > 0).sum(-1) == active).all()
    g = torch.randn_like(want)
    params = list(router.parameters())
    if params:
        for a, b in zip(torch.autograd.grad((got * g).sum(), params), torch.autograd.grad((want * g).sum(), params)):
            torch.testing.assert_close(a, b)


def test_mixed_attention_matches_a_per_head_loop():
    """o = sum_h g_h head_h W_O^h, head by head, and the router's gradient through it."""
    model = spread_(zoo.apply(zoo.convert(tiny_native("qwen3_moe")), "mixture-of-heads", heads_per_token=3,
                              shared_heads=1))
    wrapped = model.model.layers[0].self_attn
    captured = {}
    wrapped.register_forward_hook(lambda m, args, kwargs, out: captured.update(kwargs=kwargs, out=out[0]),
                                  with_kwargs=True)
    model(input_ids=IDS, attention_mask=MASK, use_cache=False)
    kw = captured["kwargs"]
    x = kw.pop("hidden_states")
    heads_out = wrapped.attention(x, **kw)[0].detach()  # [B, S, heads * d], o_proj moved out
    d = heads_out.shape[-1] // 4
    gates = wrapped.router(x).gates
    w = wrapped.o_proj.weight
    want = sum(gates[..., h:h + 1] * (heads_out[..., h * d:(h + 1) * d] @ w[:, h * d:(h + 1) * d].T)
               for h in range(4))
    got = wrapped(x, **kw)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, captured["out"])
    g = torch.randn_like(want)
    params = list(wrapped.router.parameters())
    for a, b in zip(torch.autograd.grad((got * g).sum(), params), torch.autograd.grad((want * g).sum(), params)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe", "deepseek_v3"])
def test_all_heads_with_a_fresh_router_is_exactly_the_model(family):
    model = zoo.convert(tiny_native(family))
    with torch.no_grad():
        ref = model(input_ids=IDS, attention_mask=MASK).logits
        zoo.apply(model, "mixture-of-heads", heads_per_token=1.0, shared_heads=1)
        out = model(input_ids=IDS, attention_mask=MASK).logits
    assert all(isinstance(layer.self_attn, MixedHeadsAttention) for layer in model.model.layers)
    assert torch.equal(out, ref)  # every gate is exactly 1


@pytest.mark.parametrize("options, active, shared", [
    ({"heads_per_token": 0.5}, 2, 1), ({"heads_per_token": 0.75}, 3, 1), ({"heads_per_token": 0.9}, 3, 1),
    ({"heads_per_token": 2, "shared_heads": 0}, 2, 0), ({"heads_per_token": 3, "shared_heads": 0.5}, 3, 2),
])
def test_heads_per_token(options, active, shared):
    model = spread_(zoo.apply(zoo.convert(tiny_native("mixtral")), "mixture-of-heads", **options))
    seen = []
    for layer in model.model.layers:
        layer.self_attn.router.register_forward_hook(lambda m, args, out: seen.append(out))
    model(input_ids=IDS, attention_mask=MASK)
    assert len(seen) == 2
    for routing in seen:
        on = routing.gates > 0
        assert (on.sum(-1) == active).all()
        assert on[..., :shared].all()
        if active - shared < 4 - shared:
            assert on[..., shared:].flatten(0, 1).unique(dim=0).shape[0] > 1  # the choice varies by token
    assert model.config.zoo_attention[0] == {"router": "mixture-of-heads",
                                             "options": {"heads_per_token": active, "shared_heads": shared}}


def test_save_reload_identical_logits_and_recipe(tmp_path):
    model = spread_(zoo.apply(zoo.convert(tiny_native("mixtral")), "mixture-of-heads", heads_per_token=0.5))
    assert reload_max_diff(model, IDS, tmp_path) < 1e-5
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(isinstance(layer.self_attn, MixedHeadsAttention) for layer in again.model.layers)
    assert again.config.zoo_recipe[-1]["name"] == "mixture-of-heads"
    assert again.config.zoo_recipe[-1]["options"] == {"heads_per_token": 0.5}
    assert "Router: mixture-of-heads" in (tmp_path / "README.md").read_text()
    # applying again replaces the routers, not the attention
    zoo.apply(again, "mixture-of-heads", heads_per_token=4, shared_heads=0)
    assert [s["name"] for s in again.config.zoo_recipe[-2:]] == ["mixture-of-heads"] * 2
    assert again.model.layers[0].self_attn.router.options == {"heads_per_token": 4, "shared_heads": 0}
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=IDS).logits, zoo.convert(tiny_native("mixtral"))(input_ids=IDS).logits)


@pytest.mark.parametrize("options, error, message", [
    ({"heads_per_token": 0}, ValueError, "at least 1"),
    ({"heads_per_token": 5}, ValueError, "has 4"),
    ({"heads_per_token": 1.5}, ValueError, r"in \(0, 1\]"),
    ({"heads_per_token": "half"}, ValueError, "heads_per_token.* must be float"),
    ({"heads_per_token": True}, ValueError, "heads_per_token.* must be float"),
    ({"heads_per_token": 2, "shared_heads": 2}, ValueError, "no routed head"),
    ({"heads_per_token": 0.5, "shared_heads": 3}, ValueError, "must be fewer"),
    ({"top_k": 2}, ValueError, "unknown option 'top_k'"),
    ({"heads_per_tokens": 2}, ValueError, "did you mean 'heads_per_token'"),
])
@pytest.mark.parametrize("native", [False, True])
def test_bad_options_leave_the_model_unchanged(options, error, message, native):
    model = tiny_native("mixtral") if native else zoo.convert(tiny_native("mixtral"))
    cls, state = type(model), {k: v.clone() for k, v in model.state_dict().items()}
    attention = [layer.self_attn for layer in model.model.layers]
    recipe = getattr(model.config, "zoo_recipe", None)
    with pytest.raises(error, match=message):
        zoo.apply(model, "mixture-of-heads", **options)
    assert type(model) is cls and [layer.self_attn for layer in model.model.layers] == attention
    assert all(type(a.o_proj) is torch.nn.Linear for a in attention)
    assert model.state_dict().keys() == state.keys() and all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert getattr(model.config, "zoo_recipe", None) == recipe and not getattr(model.config, "zoo_attention", None)


def test_kv_cache_decoding_matches_the_full_forward():
    """Gates depend only on the token's own hidden state: decoding with a cache sees the same heads."""
    model = spread_(zoo.apply(zoo.convert(tiny_native("mixtral")), "mixture-of-heads", heads_per_token=2))
    ids = IDS[:1]
    with torch.no_grad():
        full = model(input_ids=ids).logits
        out = model(input_ids=ids[:, :5], use_cache=True)
        steps = [out.logits]
        cache = out.past_key_values
        for t in range(5, ids.shape[1]):
            out = model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-5)


def test_balance_loss():
    router = MixtureOfHeads(12, 6, heads_per_token=3, shared_heads=1)
    assert head_balance_loss(router(torch.randn(10, 12))).item() == pytest.approx(1.0)  # zero router: uniform P
    spread_(router, std=1.0)
    routing = router(torch.randn(2, 7, 12))
    probs, chosen = routing.probs.reshape(-1, 5), routing.chosen.reshape(-1, 5).float()
    want = 5 * (chosen.mean(0) / 2 * probs.mean(0)).sum()
    torch.testing.assert_close(head_balance_loss(routing), want)
    mask = torch.tensor([[1] * 7, [0] * 3 + [1] * 4])
    keep = mask.reshape(-1).bool()
    want = 5 * (chosen[keep].mean(0) / 2 * probs[keep].mean(0)).sum()
    torch.testing.assert_close(head_balance_loss(routing, mask), want)


def test_tuning_the_router_lowers_the_loss():
    """A few AdamW steps on the head routers alone (the rest frozen) with the balance loss, 50% of the heads."""
    model = zoo.apply(zoo.convert(tiny_native("mixtral")), "mixture-of-heads", heads_per_token=0.5)
    for p in model.parameters():
        p.requires_grad_(False)
    params = [p for layer in model.model.layers for p in layer.self_attn.router.parameters()]
    for p in params:
        p.requires_grad_(True)
    routings = []
    for layer in model.model.layers:
        layer.self_attn.router.register_forward_hook(lambda m, args, out: routings.append(out))
    optimizer = torch.optim.AdamW(params, lr=0.05)
    torch.manual_seed(0)
    ids = torch.randint(3, 128, (4, 16))
    losses = []
    for _ in range(8):
        routings.clear()
        lm = model(input_ids=ids, labels=ids).loss
        balance = torch.stack([head_balance_loss(r) for r in routings]).mean()
        (lm + 0.01 * balance).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(lm.item())
    assert losses[-1] < losses[0] - 1e-3, losses
