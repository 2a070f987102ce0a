"""channel-topk against its masked reference: same selection, full down projection with the rest zeroed."""
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import zoo
from zoo.layout import moe_layers
from zoo.moe import Routing
from zoo.moe.channel_topk import ChannelTopKExperts
from zoo.moe.experts import SwiGLUExperts
from tiny import tiny_native


def masked_reference(ex: ChannelTopKExperts, e: int, x: torch.Tensor) -> torch.Tensor:
    h = ex.glu(F.linear(x, ex.gate_up_proj[e]))
    score = h.abs() * ex.down_proj[e].norm(dim=0)
    keep = torch.zeros_like(h).scatter(1, score.topk(ex.channels, dim=-1).indices, 1.0)
    return F.linear(h * keep, ex.down_proj[e])


@pytest.mark.parametrize("budget", [0.25, 0.5, 1.0])
def test_reads_only_kept_channels_and_matches_the_masked_reference(budget):
    torch.manual_seed(0)
    dense = SwiGLUExperts(4, 32, 64)
    ex = ChannelTopKExperts.from_dense(dense, budget)
    assert ex.channels == int(64 * budget)
    x = torch.randn(9, 32, requires_grad=True)
    for e in range(4):
        out = ex.expert(e, x)
        ref = masked_reference(ex, e, x)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        g_out, = torch.autograd.grad(out.sum(), x)
        g_ref, = torch.autograd.grad(ref.sum(), x)
        torch.testing.assert_close(g_out, g_ref, rtol=1e-5, atol=1e-6)
    if budget == 1.0:
        routing = Routing(torch.rand(9, 2), torch.randint(0, 4, (9, 2)))
        torch.testing.assert_close(ex(x, routing), dense(x, routing), rtol=1e-5, atol=1e-6)


def test_norm_cache_follows_weight_updates():
    ex = ChannelTopKExperts.from_dense(SwiGLUExperts(2, 16, 32), 0.5)
    before = ex.column_norms().clone()
    with torch.no_grad():
        ex.down_proj.mul_(2)
    torch.testing.assert_close(ex.column_norms(), before * 2)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_apply_roundtrip(family, tmp_path):
    model = zoo.convert(tiny_native(family))
    ids = torch.randint(3, 128, (2, 12))
    zoo.apply(model, "channel-topk", budget=0.5)
    assert all(isinstance(m.experts, ChannelTopKExperts) for _, m in moe_layers(model))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    with torch.no_grad():
        assert (loaded(input_ids=ids).logits - logits).abs().max() < 1e-6


@pytest.mark.parametrize("budget", [0, 1.5, "half", True])
def test_bad_budget_is_rejected_first(budget):
    model = zoo.convert(tiny_native("mixtral"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="budget"):
        zoo.apply(model, "channel-topk", budget=budget)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
