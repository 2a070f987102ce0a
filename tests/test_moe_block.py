"""SparseMoE / SwiGLUExperts / SharedMLP against a naive per-token reference written out here.

The reference loops over tokens and their k routing slots, computes each expert's MLP from the fused
``gate_up_proj [E, 2I, H]`` (gate rows first, then up rows) and ``down_proj [E, H, I]`` explicitly,
weights it and sums. Outputs and gradients are compared in fp32 (tight) and bf16 (the reference then
runs in fp32 on the bf16-cast weights, with a tolerance scaled for bf16).
"""
from pathlib import Path

import pytest
import torch

from zoo.moe import Routing, SharedMLP, SparseMoE, SwiGLUExperts
from zoo_routers.topk_softmax import TopKSoftmax

H, I = 16, 8  # hidden, expert intermediate size
DTYPES = [torch.float32, torch.bfloat16]
PATHS = {"sorted": "_forward_sorted", "gather": "_forward_gather", "auto": "forward"}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest


# ----------------------------------------------------------------------------------------- reference

def ref_glu(gate, up, activation, limit=7.0, alpha=1.702):
    if activation == "silu":
        return gate * torch.sigmoid(gate) * up
    assert activation == "clamped-swiglu"
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(alpha * gate))


def ref_experts(x, weights, indices, p, activation="silu", limit=7.0, alpha=1.702):
    """Naive MoE: ``x [T, H]``, ``weights/indices [T, k]``, ``p`` a dict of fp32 expert tensors."""
    gate_up, down = p["gate_up_proj"], p["down_proj"]
    b1, b2 = p.get("gate_up_proj_bias"), p.get("down_proj_bias")
    num_experts, inter = gate_up.shape[0], gate_up.shape[1] // 2
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for j in range(indices.shape[1]):
            e = int(indices[t, j])
            if e == num_experts:  # empty slot
                continue
            h = gate_up[e] @ x[t]
            if b1 is not None:
                h = h + b1[e]
            a = ref_glu(h[:inter], h[inter:], activation, limit, alpha)
            y = down[e] @ a
            if b2 is not None:
                y = y + b2[e]
            acc = acc + weights[t, j] * y
        rows.append(acc)
    return torch.stack(rows)


def ref_shared(x, p, prefix="shared."):
    gate = x @ p[prefix + "gate_proj.weight"].T
    up = x @ p[prefix + "up_proj.weight"].T
    out = (gate * torch.sigmoid(gate) * up) @ p[prefix + "down_proj.weight"].T
    if prefix + "gate.weight" in p:
        out = torch.sigmoid(x @ p[prefix + "gate.weight"].T) * out
    return out


def ref_topk_softmax_weights(x, p, indices, norm_topk_prob):
    """Routing weights of TopKSoftmax at the given (already selected) expert indices."""
    logits = x @ p["router.weight"].T
    if "router.bias" in p:
        logits = logits + p["router.bias"]
    probs = torch.exp(logits - logits.max(-1, keepdim=True).values)
    probs = probs / probs.sum(-1, keepdim=True)
    w = probs.gather(1, indices)
    return w / w.sum(-1, keepdim=True) if norm_topk_prob else w


# ------------------------------------------------------------------------------------------- helpers

def spread_(module, std=0.3):
    """Give every parameter (biases included) real spread so mistakes cannot hide behind zeros."""
    with torch.no_grad():
        for prm in module.parameters():
            prm.normal_(0.0, std)
    return module


def make_experts(num_experts, dtype, bias=False, activation="silu", **kw):
    ex = SwiGLUExperts(num_experts, H, I, activation=activation, bias=bias, **kw)
    return spread_(ex).to(dtype)


def fp32_leaves(module, prefix=""):
    return {prefix + n: prm.detach().float().requires_grad_() for n, prm in module.named_parameters()}


def random_routing(tokens, num_experts, k, dtype):
    indices = torch.rand(tokens, num_experts).argsort(-1)[:, :k]  # k distinct experts per token
    weights = (torch.rand(tokens, k) + 0.1).to(dtype)
    return weights, indices


def assert_close(actual, expected, dtype, name=""):
    assert actual is not None, f"{name}: no gradient"
    assert actual.shape == expected.shape, name
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    else:
        # bf16 keeps 8 significant bits (eps 2^-8 ~ 0.4%); a few roundings in a row stay within a few %.
        # The small absolute floor covers gradients that are zero in exact arithmetic (k=1 renormalised
        # weights are exactly 1, so the router gets only rounding noise).
        scale = expected.abs().max().item() + 1e-3
        torch.testing.assert_close(actual.float(), expected, rtol=3e-2, atol=3e-2 * scale,
                                   msg=lambda m: f"{name}: {m}")


def run_experts(ex, path, x, weights, indices):
    """Module forward + backward with a random cotangent; returns (out, grads by name, cotangent)."""
    x = x.detach().clone().requires_grad_()
    weights = weights.detach().clone().requires_grad_()
    out = getattr(ex, PATHS[path])(x, Routing(weights, indices))
    g = torch.randn(out.shape).to(out.dtype)
    out.backward(g)
    grads = {"hidden": x.grad, "routing_weights": weights.grad}
    grads.update({n: prm.grad for n, prm in ex.named_parameters()})
    return out, grads, g


def run_reference(ex, x, weights, indices, g, activation="silu"):
    p = fp32_leaves(ex)
    xr = x.detach().float().requires_grad_()
    wr = weights.detach().float().requires_grad_()
    out = ref_experts(xr, wr, indices, p, activation, ex.swiglu_limit, ex.swiglu_alpha)
    out.backward(g.float())
    grads = {"hidden": xr.grad, "routing_weights": wr.grad}
    grads.update({n: t.grad for n, t in p.items()})
    return out, grads


def check_against_reference(ex, path, x, weights, indices, dtype, activation="silu"):
    out, grads, g = run_experts(ex, path, x, weights, indices)
    ref_out, ref_grads = run_reference(ex, x, weights, indices, g, activation)
    assert out.dtype == dtype
    assert_close(out, ref_out, dtype, "output")
    assert set(grads) == set(ref_grads)
    for name in ref_grads:
        assert_close(grads[name], ref_grads[name], dtype, f"grad {name}")
    return out, grads


# -------------------------------------------------------------------------------- experts vs reference

@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("num_experts", [4, 8])
@pytest.mark.parametrize("path", ["sorted", "gather"])
def test_experts_match_reference(path, num_experts, k, tokens, bias, dtype):
    torch.manual_seed(1000 * num_experts + 100 * k + tokens)
    ex = make_experts(num_experts, dtype, bias=bias)
    x = torch.randn(tokens, H).to(dtype)
    weights, indices = random_routing(tokens, num_experts, k, dtype)
    check_against_reference(ex, path, x, weights, indices, dtype)


@pytest.mark.parametrize("native", [True, False], ids=["bf16-native", "bf16-not-native"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_bf16_experts_multiply_in_fp32_where_bf16_is_not_native(monkeypatch, native, bias):
    """On a CPU without native bf16 products (AVX2-only) the eager experts widen to fp32 and round back: the same
    reference, outputs and gradients in bf16, the products in fp32."""
    from zoo.moe import cpu_precision

    monkeypatch.setattr(cpu_precision, "bf16_matmul_is_native", lambda: native)
    real, seen = torch.nn.functional.linear, []
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda a, b, *r: seen.append((a.dtype, b.dtype)) or real(a, b, *r))
    torch.manual_seed(7)
    ex = make_experts(8, torch.bfloat16, bias=bias)
    x = torch.randn(64, H).to(torch.bfloat16)
    weights, indices = random_routing(64, 8, 2, torch.bfloat16)
    _, grads = check_against_reference(ex, "sorted", x, weights, indices, torch.bfloat16)
    product = torch.bfloat16 if native else torch.float32
    assert seen and set(seen) == {(product, product)}
    assert all(grads[n].dtype == torch.bfloat16 for n, _ in ex.named_parameters())


@pytest.mark.parametrize("native", [True, False], ids=["bf16-native", "bf16-not-native"])
@pytest.mark.parametrize("part", ["router", "factored", "channel-topk"])
def test_routers_and_other_experts_multiply_bf16_in_fp32_where_bf16_is_not_native(monkeypatch, native, part):
    """``cpu_precision.linear``: a router's logits, factored experts and channel-topk experts (prefill: masks over
    whole matrices) take their bf16 products in fp32 where bf16 is not native, each output rounded once to bf16; the
    same results as the module in fp32 up to bf16 rounding, outputs and gradients."""
    import copy

    from zoo.moe import cpu_precision
    from zoo.moe.channel_topk import ChannelTopKExperts
    from zoo.moe.factored import FactoredExperts

    monkeypatch.setattr(cpu_precision, "bf16_matmul_is_native", lambda: native)
    torch.manual_seed(11)
    x = torch.randn(64, H)
    routing = Routing(torch.rand(64, 2), torch.randint(0, 8, (64, 2)))
    if part == "router":
        module = spread_(TopKSoftmax(H, 8, 2, bias=True), std=0.5)
        run = lambda m, t: m.gate_logits(t)  # noqa: E731
    elif part == "factored":
        module = FactoredExperts(8, H, I, rank_gate_up=8, rank_down=6, num_u=4, bias=True)
        with torch.no_grad():
            for p in module.parameters():
                p.normal_(0, 0.3)
        run = lambda m, t: m(t, routing)  # noqa: E731
    else:
        module = ChannelTopKExperts.from_dense(make_experts(8, torch.float32), budget=0.5)
        run = lambda m, t: m(t, Routing(routing.weights.to(t.dtype), routing.indices))  # noqa: E731
    ref = copy.deepcopy(module)
    want = run(ref, x.clone().requires_grad_())
    want_grads = torch.autograd.grad(want.pow(2).sum(), list(ref.parameters()))
    low = module.to(torch.bfloat16)
    real, seen = torch.nn.functional.linear, []
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda a, b, *r: seen.append((a.dtype, b.dtype)) or real(a, b, *r))
    out = run(low, x.bfloat16())
    grads = torch.autograd.grad(out.float().pow(2).sum(), list(low.parameters()))
    product = torch.bfloat16 if native else torch.float32
    assert seen and set(seen) == {(product, product)}
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    scale = want.abs().max()
    assert (out.float() - want).abs().max() <= 0.05 * scale
    assert all((g.float() - w).abs().max() <= 0.05 * w.abs().max() + 1e-6 for g, w in zip(grads, want_grads))


@pytest.mark.parametrize("native", [True, False], ids=["bf16-native", "bf16-not-native"])
def test_widened_linear_layers_multiply_bf16_in_fp32_where_bf16_is_not_native(monkeypatch, native):
    """``widen_bf16_linears`` (opt in) gives a model's plain linear layers (attention projections, the LM head)
    ``WideningLinear`` where bf16 products are not native: the fp32 product rounded once, gradients too; the state
    dict, the kernel's swap and the adapters' linear targets see the same layers. Where bf16 is native, and by
    default, nothing changes."""
    import zoo
    from zoo.moe import cpu_precision
    from zoo.moe.kernels.linear import KernelLinear, read_linears_with_kernel

    monkeypatch.setattr(cpu_precision, "bf16_matmul_is_native", lambda: native)
    model = zoo.load("zoo-tiny-moe")
    assert model.dtype == torch.bfloat16
    linears = [m for m in model.modules() if cpu_precision.is_plain_linear(m)]
    assert len(linears) == 17 and {type(m) for m in linears} == {torch.nn.Linear}  # nothing by default
    keys = list(model.state_dict())
    assert cpu_precision.widen_bf16_linears(model) == (0 if native else 17)
    assert {type(m) for m in linears} == {torch.nn.Linear if native else cpu_precision.WideningLinear}
    assert cpu_precision.widen_bf16_linears(model) == 0  # idempotent
    real, seen = torch.nn.functional.linear, []
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda a, b, *r: seen.append((a.dtype, b.dtype)) or real(a, b, *r))
    torch.manual_seed(3)
    layer = cpu_precision.WideningLinear(H, 2 * H, dtype=torch.bfloat16)
    x = torch.randn(5, H, dtype=torch.bfloat16, requires_grad=True)
    cotangent = torch.randn(5, 2 * H, dtype=torch.bfloat16)
    out = layer(x)
    out.backward(cotangent)
    product = torch.bfloat16 if native else torch.float32
    assert out.dtype == torch.bfloat16 and seen == [(product, product)]
    leaves = [t.detach().float().requires_grad_() for t in (x, layer.weight, layer.bias)]
    want = real(*leaves)
    want.backward(cotangent.float())
    assert torch.allclose(out.float(), want, atol=0.02, rtol=0.01)
    if not native:  # widened: the reference's fp32 results, each rounded once
        assert torch.equal(out, want.bfloat16())
        assert all(torch.equal(t.grad, ref.grad.bfloat16()) for t, ref in zip((x, layer.weight, layer.bias), leaves))
    rows = []  # the output rows of each bf16 product in a forward: only the routers' (8 experts) when widened

    def counted(a, b, *rest):
        if a.dtype == b.dtype == torch.bfloat16:
            rows.append(b.shape[0])
        return real(a, b, *rest)

    monkeypatch.setattr(torch.nn.functional, "linear", counted)
    with torch.no_grad():
        model(input_ids=torch.tensor([[3, 5, 7, 11]]))
    assert bool(rows) == native  # widened: none left (the routers' logits widen on their own)
    assert read_linears_with_kernel(model) == 17 and all(type(m) is KernelLinear for m in linears)
    assert list(model.state_dict()) == keys


def test_widened_linear_layers_under_a_device_maps_hooks_give_the_same_logits(monkeypatch, tmp_path):
    """A device map with a layer on disk puts accelerate's hooks on every plain linear: ``widen_bf16_linears`` widens
    them under their hooks, and the logits equal the widened model's in memory, bit for bit."""
    import zoo
    from transformers import AutoModelForCausalLM

    from zoo.moe import cpu_precision

    monkeypatch.setattr(cpu_precision, "bf16_matmul_is_native", lambda: False)
    model = zoo.load("zoo-tiny-moe").eval()
    model.save_pretrained(tmp_path / "m")
    assert cpu_precision.widen_bf16_linears(model) == 17
    ids = torch.tensor([[3, 5, 7, 11, 13, 17]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
    disk = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu",
            **{f"model.layers.{i}": "disk" if i == 3 else "cpu" for i in range(4)}}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", device_map=disk,
                                                  offload_folder=tmp_path / "offload").eval()
    hooked = [m for m in loaded.modules() if type(m) is torch.nn.Linear and hasattr(m, "_hf_hook")]
    assert len(hooked) == 17 and cpu_precision.widen_bf16_linears(loaded) == 17
    assert all(m._old_forward.__func__ is cpu_precision.WideningLinear.forward for m in hooked)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens,num_experts,k", [(1, 8, 2), (2, 8, 2), (3, 8, 2), (4, 8, 2), (5, 8, 2),
                                                  (1, 4, 1), (7, 4, 1), (64, 8, 2)])
def test_dispatch_paths_agree(tokens, num_experts, k, dtype):
    torch.manual_seed(tokens + 17 * num_experts + k)
    ex = make_experts(num_experts, dtype, bias=True)
    x = torch.randn(tokens, H).to(dtype)
    weights, indices = random_routing(tokens, num_experts, k, dtype)
    torch.manual_seed(0)
    out_s, grads_s, _ = run_experts(ex, "sorted", x, weights, indices)
    ex.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # same cotangent
    out_g, grads_g, _ = run_experts(ex, "gather", x, weights, indices)
    assert_close(out_g, out_s.float(), dtype, "output")
    for name in grads_s:
        assert_close(grads_g[name], grads_s[name].float(), dtype, f"grad {name}")


@pytest.mark.parametrize("tokens,num_experts,k,expected", [
    (1, 8, 2, "gather"), (3, 8, 2, "gather"), (4, 8, 2, "gather"), (5, 8, 2, "sorted"),
    (8, 8, 1, "gather"), (9, 8, 1, "sorted"), (64, 4, 2, "sorted"),
])
@pytest.mark.parametrize("compiling", [False, True])
def test_forward_picks_path(monkeypatch, tokens, num_experts, k, expected, compiling):
    """Gather only inside a compiled graph (decode, T*k <= E); eager always sorts (no weight copies)."""
    ex = make_experts(num_experts, torch.float32)
    called = []
    for path in ("sorted", "gather"):
        original = getattr(ex, PATHS[path])
        monkeypatch.setattr(ex, PATHS[path], lambda *a, _p=path, _f=original: called.append(_p) or _f(*a))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    weights, indices = random_routing(tokens, num_experts, k, torch.float32)
    out = ex(torch.randn(tokens, H), Routing(weights, indices))
    assert called == [expected if compiling else "sorted"]
    assert out.shape == (tokens, H)


# -------------------------------------------------------------------- idle experts and empty slots

E_IDLE = 8
USED = {1, 2, 5}
IDLE = sorted(set(range(E_IDLE)) - USED)  # includes E-1, which the gather path clamps empty slots onto


def idle_routing(dtype):
    indices = torch.tensor([[1, 2], [5, 8], [2, 1], [8, 8], [5, 1], [2, 8]])
    weights = torch.tensor([[0.7, 0.3], [0.9, 5.0], [0.2, 0.4], [-3.0, 11.0], [0.5, 0.5], [1.0, 123.0]])
    return weights.to(dtype), indices


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", ["sorted", "gather"])
def test_idle_experts_get_exactly_zero_gradient(path, dtype):
    torch.manual_seed(3)
    ex = make_experts(E_IDLE, dtype, bias=True)
    weights, indices = idle_routing(dtype)
    x = torch.randn(indices.shape[0], H).to(dtype)
    _, grads = check_against_reference(ex, path, x, weights, indices, dtype)
    for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
        g = grads[name]
        assert torch.count_nonzero(g[IDLE]) == 0, f"{name}: idle experts got gradient"
        for e in USED:
            assert torch.count_nonzero(g[e]) > 0, f"{name}: used expert {e} got no gradient"


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", ["sorted", "gather"])
def test_empty_slots_are_ignored(path, dtype):
    torch.manual_seed(4)
    ex = make_experts(E_IDLE, dtype, bias=True)
    weights, indices = idle_routing(dtype)
    empty = indices == E_IDLE
    x = torch.randn(indices.shape[0], H).to(dtype)
    out, grads, _ = run_experts(ex, path, x, weights, indices)
    # Same routing with the empty slots' weights zeroed and pointed at a real expert: identical output.
    twin_idx = indices.masked_fill(empty, 3)
    twin_w = weights.masked_fill(empty, 0.0)
    twin = getattr(ex, PATHS[path])(x, Routing(twin_w, twin_idx))
    torch.testing.assert_close(out, twin, rtol=0, atol=0)
    assert torch.count_nonzero(out[3]) == 0  # token 3 has only empty slots (and no bias leaks in)
    assert torch.count_nonzero(grads["routing_weights"][empty]) == 0
    assert torch.count_nonzero(grads["routing_weights"][~empty]) == int((~empty).sum())


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("path", ["sorted", "gather"])
def test_empty_slot_weight_is_ignored_even_if_not_finite(path, bad):
    # Routing says an empty slot's weight is ignored: masked out, not multiplied by 0 (inf * 0 = NaN).
    torch.manual_seed(5)
    ex = make_experts(E_IDLE, torch.float32)
    indices = torch.tensor([[0, 8], [3, 8]])
    weights = torch.tensor([[0.6, bad], [0.4, bad]])
    x = torch.randn(2, H)
    out = getattr(ex, PATHS[path])(x, Routing(weights, indices))
    expected = ref_experts(x, weights, indices, fp32_leaves(ex))
    torch.testing.assert_close(out, expected.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["sorted", "gather", "auto"])
def test_no_tokens(path):
    ex = make_experts(8, torch.float32)
    out = getattr(ex, PATHS[path])(torch.zeros(0, H), Routing(torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.long)))
    assert out.shape == (0, H)


# ------------------------------------------------------------------------------------ clamped-swiglu

def test_clamped_swiglu_formula_by_hand():
    ex = SwiGLUExperts(2, H, 1, activation="clamped-swiglu")  # GPT-OSS defaults: limit 7.0, alpha 1.702
    gate_up = torch.tensor([[10.0, -10.0], [-2.0, 3.0], [0.5, 9.0]])  # [gate | up] with I = 1
    got = ex.glu(gate_up).squeeze(-1)
    s = torch.sigmoid
    expected = torch.tensor([
        (-7.0 + 1) * 7.0 * s(torch.tensor(1.702 * 7.0)),  # gate clamped to +limit, up to -limit
        (3.0 + 1) * -2.0 * s(torch.tensor(1.702 * -2.0)),  # nothing clamped
        (7.0 + 1) * 0.5 * s(torch.tensor(1.702 * 0.5)),  # up clamped to +limit
    ])
    torch.testing.assert_close(got, expected)
    # and plain silu for comparison: silu(gate) * up
    silu = SwiGLUExperts(2, H, 1).glu(gate_up).squeeze(-1)
    torch.testing.assert_close(silu, gate_up[:, 0] * s(gate_up[:, 0]) * gate_up[:, 1])


def test_the_two_clamped_silus_by_hand():
    """DeepSeek-V4 clamps the gate before the SiLU, Step 3.7 the SiLU's output: they differ where the gate passes the
    limit (silu(7) = 6.99 against 7 for a gate of 10)."""
    gate_up = torch.tensor([[10.0, 20.0], [2.0, -3.0], [-9.0, 1.0]])  # [gate | up] with I = 1
    gate, s = gate_up[:, 0], torch.sigmoid
    before = SwiGLUExperts(2, H, 1, activation="clamped-silu", swiglu_limit=2.5).glu(gate_up).squeeze(-1)
    after = SwiGLUExperts(2, H, 1, activation="post-clamped-silu", swiglu_limit=2.5).glu(gate_up).squeeze(-1)
    torch.testing.assert_close(before, torch.stack([2.5 * s(torch.tensor(2.5)) * 2.5, gate[1] * s(gate[1]) * -2.5,
                                                    gate[2] * s(gate[2]) * 1.0]))
    torch.testing.assert_close(after, torch.stack([torch.tensor(2.5 * 2.5), gate[1] * s(gate[1]) * -2.5,
                                                   gate[2] * s(gate[2]) * 1.0]))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [3, 64])
@pytest.mark.parametrize("path", ["sorted", "gather"])
def test_clamped_swiglu_with_biases_matches_reference(path, tokens, dtype):
    torch.manual_seed(6 + tokens)
    limit, alpha = 0.75, 1.702  # a small limit so that both clamps are active on this data
    ex = make_experts(8, dtype, bias=True, activation="clamped-swiglu", swiglu_limit=limit, swiglu_alpha=alpha)
    weights, indices = random_routing(tokens, 8, 2, dtype)
    x = torch.randn(tokens, H).to(dtype)
    # Keep pre-activations away from the clamp kinks, so bf16 rounding cannot flip a value across one
    # (the clamp's gradient jumps between 0 and 1 there). Redraw the tokens that come too close.
    for _ in range(200):
        h = torch.einsum("tkoh,th->tko", ex.gate_up_proj.float()[indices], x.float())
        h = h + ex.gate_up_proj_bias.float()[indices]
        gate, up = h[..., :I], h[..., I:]
        near = ((gate - limit).abs() < 0.03).flatten(1).any(1) | ((up.abs() - limit).abs() < 0.03).flatten(1).any(1)
        if not near.any():
            break
        x[near] = torch.randn(int(near.sum()), H).to(dtype)
    assert not near.any()
    assert (gate > limit).any() and (gate < limit).any() and (up.abs() > limit).any() and (up.abs() < limit).any()
    check_against_reference(ex, path, x, weights, indices, dtype, activation="clamped-swiglu")


# ---------------------------------------------------------------------------------------- SharedMLP

@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_shared_mlp_matches_reference(gated):
    torch.manual_seed(7)
    shared = spread_(SharedMLP(H, 12, gated=gated))
    assert (shared.gate is not None) == gated
    x = torch.randn(9, H, requires_grad=True)
    out = shared(x)
    g = torch.randn_like(out)
    out.backward(g)
    p = fp32_leaves(shared, prefix="shared.")
    xr = x.detach().clone().requires_grad_()
    ref = ref_shared(xr, p)
    ref.backward(g)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-5)
    for name, prm in shared.named_parameters():
        torch.testing.assert_close(prm.grad, p["shared." + name].grad, rtol=1e-5, atol=1e-5)
    if gated:  # the sigmoid gate really scales the output
        ungated = shared.down_proj(torch.nn.functional.silu(shared.gate_proj(x)) * shared.up_proj(x))
        assert not torch.allclose(out, ungated)


# ---------------------------------------------------------------------------------- full SparseMoE

def make_block(num_experts, k, dtype, shared=None, norm_topk_prob=True, expert_bias=True, router_bias=True):
    router = spread_(TopKSoftmax(H, num_experts, k, bias=router_bias, norm_topk_prob=norm_topk_prob), std=0.5)
    experts = make_experts(num_experts, torch.float32, bias=expert_bias)
    shared_mlp = None if shared is None else spread_(SharedMLP(H, 12, gated=shared == "gated"))
    return SparseMoE(router, experts, shared_mlp).to(dtype)


def check_block(moe, hidden, dtype, norm_topk_prob=True):
    hidden = hidden.detach().clone().requires_grad_()
    out = moe(hidden)
    assert out.shape == hidden.shape and out.dtype == dtype
    g = torch.randn(out.shape).to(dtype)
    out.backward(g)
    x = hidden.detach().reshape(-1, H)
    with torch.no_grad():
        indices = moe.router(x).indices  # discrete: no gradient flows through the selection

    p = {n: prm.detach().float().requires_grad_() for n, prm in moe.named_parameters()}
    xr = x.float().requires_grad_()
    if dtype == torch.float32:  # the selection itself is checked too (bf16 may break near-ties differently)
        logits = xr.detach() @ p["router.weight"].detach().T
        if "router.bias" in p:
            logits = logits + p["router.bias"].detach()
        assert torch.equal(logits.topk(moe.top_k, dim=-1).indices, indices)
    weights = ref_topk_softmax_weights(xr, p, indices, norm_topk_prob)
    experts = {n[len("experts."):]: t for n, t in p.items() if n.startswith("experts.")}
    ref = ref_experts(xr, weights, indices, experts)
    if moe.shared_experts is not None:
        ref = ref + ref_shared(xr, p, prefix="shared_experts.")
    ref.backward(g.reshape(-1, H).float())

    assert_close(out.reshape(-1, H), ref, dtype, "output")
    assert_close(hidden.grad.reshape(-1, H), xr.grad, dtype, "grad hidden")
    for name, prm in moe.named_parameters():
        assert_close(prm.grad, p[name].grad, dtype, f"grad {name}")
    return indices


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 1), (1, 3), (1, 5), (4, 16)], ids=lambda s: f"T{s[0] * s[1]}")
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("num_experts", [4, 8])
def test_sparse_moe_matches_reference(num_experts, k, shape, dtype):
    torch.manual_seed(100 * num_experts + 10 * k + shape[0] * shape[1])
    moe = make_block(num_experts, k, dtype, shared="gated")
    check_block(moe, torch.randn(*shape, H).to(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["norm", "nonorm"])
@pytest.mark.parametrize("shared", [None, "plain", "gated"])
def test_sparse_moe_variants(shared, norm_topk_prob, dtype):
    torch.manual_seed(11)
    moe = make_block(8, 2, dtype, shared=shared, norm_topk_prob=norm_topk_prob, expert_bias=False,
                     router_bias=False)
    assert {n.split(".")[0] for n, _ in moe.named_parameters()} == (
        {"router", "experts"} | ({"shared_experts"} if shared else set()))
    check_block(moe, torch.randn(2, 7, H).to(dtype), dtype, norm_topk_prob)


def test_sparse_moe_returns_router_scores_and_checks_expert_count():
    torch.manual_seed(12)
    moe = make_block(8, 2, torch.float32)
    moe.returns_router_scores = True
    hidden = torch.randn(2, 3, H)
    out, scores = moe(hidden)
    assert out.shape == hidden.shape
    torch.testing.assert_close(scores, moe.router(hidden.reshape(-1, H)).weights)
    moe.returns_router_scores = False
    torch.testing.assert_close(moe(hidden), out)
    with pytest.raises(ValueError, match="experts"):
        SparseMoE(TopKSoftmax(H, 8, 2), SwiGLUExperts(4, H, I))


# ------------------------------------------------------------------- weights on the input (Llama 4)

def test_input_scaled_block_matches_the_naive_reference_outputs_and_gradients():
    """``weights_scale_input``: sum over a token's slots of expert_e(w * x), written out per token and slot."""
    torch.manual_seed(0)
    experts = SwiGLUExperts(4, H, I)
    router = TopKSoftmax(H, 4, 2)
    shared = SharedMLP(H, I)
    moe = SparseMoE(router, experts, shared, weights_scale_input=True)
    x = torch.randn(2, 5, H, requires_grad=True)
    out = moe(x)
    flat = x.reshape(-1, H)
    routing = router(flat)
    rows = []
    for t in range(flat.shape[0]):
        y = shared(flat[t:t + 1])[0]
        for slot in range(2):
            e, w = int(routing.indices[t, slot]), routing.weights[t, slot]
            gate, up = (experts.gate_up_proj[e] @ (w * flat[t])).chunk(2)
            y = y + experts.down_proj[e] @ ref_glu(gate, up, "silu")
        rows.append(y)
    want = torch.stack(rows).view_as(out)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    g_out, = torch.autograd.grad(out.square().sum(), x)
    g_want, = torch.autograd.grad(want.square().sum(), x)
    torch.testing.assert_close(g_out, g_want, rtol=1e-5, atol=1e-6)
    assert moe.layout()["weights_scale_input"] is True
    assert moe.with_parts().weights_scale_input  # compressors' rebuilt blocks keep the flag


# ------------------------------------------------------------------------ ungated experts (Nemotron-H)

@pytest.mark.parametrize("compiled_path", [False, True])
def test_mlp_experts_match_the_naive_reference_outputs_and_gradients(compiled_path, monkeypatch):
    """``mlp`` experts: down(act(up x)) per token and slot, weighted, summed; both the sorted and the gather
    path (the one a compiled decode step takes), with an empty slot."""
    from zoo.moe.experts import MLPExperts

    torch.manual_seed(0)
    experts = MLPExperts(4, H, I, activation="relu2")
    x = torch.randn(3, H, requires_grad=True)
    indices = torch.tensor([[0, 2], [3, 4], [1, 1]])  # 4: an empty slot
    weights = torch.rand(3, 2)
    if compiled_path:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    out = experts(x, Routing(weights, indices))
    rows = []
    for t in range(3):
        y = torch.zeros(H)
        for slot in range(2):
            e = int(indices[t, slot])
            if e < 4:
                y = y + weights[t, slot] * (experts.down_proj[e] @ torch.relu(experts.up_proj[e] @ x[t]).square())
        rows.append(y)
    want = torch.stack(rows)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    g_out, = torch.autograd.grad(out.square().sum(), x)
    g_want, = torch.autograd.grad(want.square().sum(), x)
    torch.testing.assert_close(g_out, g_want, rtol=1e-5, atol=1e-6)


def test_ungated_shared_mlp_is_down_of_act_of_up():
    torch.manual_seed(0)
    shared = SharedMLP(H, I, activation="relu2", glu=False)
    x = torch.randn(5, H)
    torch.testing.assert_close(shared(x), shared.down_proj(torch.relu(shared.up_proj(x)).square()))
    assert shared.gate_proj is None and shared.options()["glu"] is False


@pytest.mark.parametrize("size", [(1, 2), (16, 2), (512, 2), (513, 2), (2048, 8)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_chosen_pairs_counted_on_the_host_and_in_torch_alike(size):
    """``chosen_pairs`` (the pairs that chose a real expert, and how many experts they chose), counted on the host
    up to 1024 indices and by ``bincount`` past that, against a mask and ``unique``; empty slots (>= the number of
    experts) are not counted, all-empty routings count zero."""
    from zoo.moe.experts import chosen_pairs

    g = torch.Generator().manual_seed(size[0])
    for num_experts in (4, 64):
        indices = torch.randint(0, num_experts + 3, size, generator=g)
        for case in (indices, torch.full(size, num_experts), indices.clamp(max=0)):
            real = case[case < num_experts]
            assert chosen_pairs(case, num_experts) == (real.numel(), len(real.unique()))


def test_eager_inference_loads_the_kernel_and_training_does_not():
    """Dense experts' first eager call without gradients loads the zoo's kernel (so a few tokens read the selected
    experts in place, as the quantized kinds' calls do), in a fresh process; a call with gradients loads nothing."""
    import subprocess
    import sys

    from zoo.moe import kernels

    if not kernels.load():
        pytest.skip(f"the zoo's kernel is not available here ({kernels.unavailable_reason()})")
    code = ("import torch, zoo\nfrom zoo.moe import kernels\nfrom tests.tiny import tiny_native\n"
            "m = zoo.convert(tiny_native('mixtral')).eval()\nids = torch.tensor([[5, 17, 33]])\n"
            "m(input_ids=ids)\nprint(kernels._state['tried'])\n"
            "with torch.no_grad():\n    m(input_ids=ids)\nprint(kernels.ready())\n")
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["False", "True"]
