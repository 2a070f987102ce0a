"""channel-topk: selection before the weights are read, checked against a naive per-pair reference that gathers
the selected rows and columns through a byte-counting reader; budget 1.0 is the dense experts; the bytes a
token reads are at most the budget of the expert's weights plus the selector's sketch; the calibrated
threshold baseline keeps the budget on its calibration tokens; save and reload through AutoModel."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import zoo
from zoo.moe.layout import moe_layers
from zoo.moe import Routing
from zoo.moe.channel_topk import (GATHER_TOKENS, SELECTORS, ChannelTopKExperts, ReadCounter, pack2, ternarize,
                                  unpack2)
from zoo.moe.experts import SwiGLUExperts
from zoo.testing import check_components, check_reference
from tiny import tiny_native

E, H, I = 4, 32, 64


def routing(tokens, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    return Routing(torch.rand(tokens, k, generator=g), idx)


def dense_experts(bias=False, seed=0):
    torch.manual_seed(seed)
    dense = SwiGLUExperts(E, H, I, bias=bias)
    if bias:
        with torch.no_grad():
            dense.gate_up_proj_bias.normal_(std=0.02)
            dense.down_proj_bias.normal_(std=0.02)
    return dense


def calibrated(ex, seed=1):
    g = torch.Generator().manual_seed(seed)
    ex.calibrate(torch.randn(256, H, generator=g), torch.randint(0, E, (256, 2), generator=g))
    return ex


def build(dense, rule="topk", **options):
    ex = ChannelTopKExperts.from_dense(dense, rule=rule, **options)
    return calibrated(ex) if rule == "threshold" else ex


@pytest.mark.parametrize("selector", SELECTORS)
@pytest.mark.parametrize("rule", ["topk", "threshold"])
@pytest.mark.parametrize("tokens", [3, 3 * GATHER_TOKENS])  # the gather path (decode) and the masked path (prefill)
@pytest.mark.parametrize("bias", [False, True])
def test_fast_path_matches_the_counting_reference(selector, rule, tokens, bias):
    ex = build(dense_experts(bias), rule, budget=0.25, selector=selector)
    x = torch.randn(tokens, H, requires_grad=True)
    r = routing(tokens)
    fast_count, ref_count = ReadCounter(), ReadCounter()
    ex.counter = fast_count
    out = ex(x, r)
    ex.counter = None
    ref = ex.reference(x, r, ref_count)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    params = [x, ex.gate_up_proj, ex.down_proj]
    for a, b in zip(torch.autograd.grad(out.square().sum(), params), torch.autograd.grad(ref.square().sum(), params)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert fast_count == ref_count and ref_count.pairs == 2 * tokens
    check_reference(ex, top_k=2)  # zoo.testing's own comparison (an empty slot included)


@pytest.mark.parametrize("selector", SELECTORS)
@pytest.mark.parametrize("bias", [False, True])
def test_budget_one_is_the_dense_experts(selector, bias):
    dense = dense_experts(bias)
    ex = build(dense, budget=1.0, selector=selector)
    for tokens in (2, 40):
        x = torch.randn(tokens, H, requires_grad=True)
        r = routing(tokens)
        out, want = ex(x, r), dense(x, r)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        g_out = torch.autograd.grad(out.square().sum(), [x, ex.gate_up_proj, ex.down_proj])
        g_want = torch.autograd.grad(want.square().sum(), [x, dense.gate_up_proj, dense.down_proj])
        for a, b in zip(g_out, g_want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def sketch_bytes_per_expert(ex) -> int:
    """Counted independently of the module: 2 bits per gate/up weight (packed), one scale per gate/up row, one
    norm per intermediate channel, and the rank-r map A [H, r], B [r, I], at the weights' element size."""
    es = ex.gate_up_proj.element_size()
    return 2 * I * H * 2 // 8 + 2 * I * es + I * es + ex.rank * (H + I) * es


@pytest.mark.parametrize("budget", [0.25, 0.5, 0.75])
@pytest.mark.parametrize("selector", ["sketch", "wina"])
def test_reads_at_most_the_budget_plus_the_sketch(budget, selector):
    ex = build(dense_experts(), budget=budget, selector=selector)
    tokens = 5
    count = ReadCounter()
    ex.reference(torch.randn(tokens, H), routing(tokens), count)
    expert_bytes = 3 * I * H * ex.gate_up_proj.element_size()
    assert count.pairs == 2 * tokens
    assert count.weights <= budget * expert_bytes * count.pairs  # gathered gate, up and down elements
    assert count.weights >= (budget - 1 / H) * expert_bytes * count.pairs  # and the budget is used
    sketch = sketch_bytes_per_expert(ex) if selector == "sketch" else (2 * H + I) * ex.gate_up_proj.element_size()
    assert count.selector == sketch * count.pairs


def test_down_only_reads_gate_and_up_whole():
    """The zoo's earlier variant: its read is 2/3 + budget/3 of the expert, which is why it is not the default."""
    ex = build(dense_experts(), budget=0.25, selector="down")
    count = ReadCounter()
    ex.reference(torch.randn(4, H), routing(4), count)
    assert count.weights == count.pairs * (2 * I * H + I // 4 * H) * 4


def test_the_default_is_the_papers_sketch_selector():
    ex = ChannelTopKExperts.from_dense(dense_experts(), budget=0.5)
    assert (ex.selector, ex.rule, ex.rank) == ("sketch", "topk", 8)
    assert ex.options()["selector"] == "sketch"


def test_ternary_sketch_packs_two_bits_a_weight():
    w = torch.randn(6, 10)
    t, scale = ternarize(w)
    assert set(t.unique().tolist()) <= {-1, 0, 1} and (t != 0).any() and (t == 0).any()
    packed = pack2(t)
    assert packed.dtype == torch.uint8 and packed.shape == (6, 3)
    assert torch.equal(unpack2(packed, 10), t)
    kept = w.abs() > 0.7 * w.abs().mean(-1, keepdim=True)
    torch.testing.assert_close(scale, (w.abs() * kept).sum(-1) / kept.sum(-1))


def test_low_rank_recovery_reduces_the_error_of_the_skipped_channels():
    """The recovery term must help on average (else the paper's low-rank map would be noise): same selection,
    with and without it, against the dense output."""
    torch.manual_seed(0)
    dense = SwiGLUExperts(E, 64, 128)
    with torch.no_grad():  # a low-rank down projection (as trained ones are, roughly) plus noise
        dense.down_proj.copy_(torch.randn(E, 64, 4) @ torch.randn(E, 4, 128) * 0.05 + 0.002 * torch.randn(E, 64, 128))
    x = torch.randn(64, 64)
    r = routing(64)
    want = dense(x, r)
    with_map = ChannelTopKExperts.from_dense(dense, budget=0.25, rank=8)
    without = ChannelTopKExperts.from_dense(dense, budget=0.25, rank=0)
    with torch.no_grad():
        err_with = (with_map(x, r) - want).norm()
        err_without = (without(x, r) - want).norm()
    assert err_with < err_without


def test_sketch_follows_weight_updates():
    ex = ChannelTopKExperts.from_dense(dense_experts(), 0.5)
    before = ex.sketch().down_norms.clone()
    with torch.no_grad():
        ex.down_proj.mul_(2)
    torch.testing.assert_close(ex.sketch().down_norms, before * 2)


def test_threshold_keeps_the_budget_on_its_calibration_tokens_and_varies_per_token():
    ex = ChannelTopKExperts.from_dense(dense_experts(), budget=0.3, selector="sketch", rule="threshold")
    g = torch.Generator().manual_seed(3)
    x, idx = torch.randn(400, H, generator=g), torch.randint(0, E, (400, 2), generator=g)
    kept = ex.calibrate(x, idx)
    assert abs(kept["down"] - 0.3) < 0.01
    counts = [(ex.scores(e, x[(idx == e).any(-1)])["down"] > ex.thresholds[e, 2]).sum(-1) for e in range(E)]
    fraction = torch.cat(counts).float().mean() / I
    assert abs(float(fraction) - 0.3) < 0.01
    assert len(torch.cat(counts).unique()) > 1  # not a fixed count: a threshold


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("options", [{"budget": 0.5}, {"budget": 0.5, "selector": "wina"},
                                     {"budget": 0.5, "rule": "threshold"}])
def test_apply_roundtrip(family, options, tmp_path):
    model = zoo.convert(tiny_native(family))
    ids = torch.randint(3, 128, (2, 12))
    calibration = [torch.randint(3, 128, (2, 16))] if options.get("rule") == "threshold" else None
    zoo.apply(model, "channel-topk", calibration=calibration, **options)
    experts = [m.experts for _, m in moe_layers(model)]
    assert all(isinstance(ex, ChannelTopKExperts) for ex in experts)
    if options.get("rule") == "threshold":
        assert all(ex.thresholds.abs().sum() > 0 for ex in experts)
        assert model.config.zoo_recipe[-1]["results"]["calibrated_kept"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    with torch.no_grad():
        assert (loaded(input_ids=ids).logits - logits).abs().max() < 1e-6


@pytest.mark.parametrize("options", [{"budget": 0}, {"budget": 1.5}, {"budget": "half"}, {"budget": True},
                                     {"selector": "oracle"}, {"rule": "mean"}, {"rank": -1},
                                     {"selector": "wina", "rank": 4}, {"rank": 1000}])
def test_bad_options_are_rejected_first(options):
    model = zoo.convert(tiny_native("mixtral"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="budget|selector|rule|rank"):
        zoo.apply(model, "channel-topk", **options)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_check_component_end_to_end():
    """The options tests/test_check_component.py's batch does not take (it checks budget 0.5 with the default
    selector, both kinds), in one batch: one fresh process reloads both."""
    reports = check_components([("channel-topk", {"budget": 0.25, "selector": "wina", "rule": "threshold"}),
                                ("experts:channel-topk", {"budget": 0.5, "selector": "sketch", "rank": 4})])
    assert all(r["families"] for r in reports), reports
