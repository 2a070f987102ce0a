"""moe-svd: factored experts against their reconstructed dense reference; the decomposition itself."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import zoo
from zoo.layout import moe_layers
from zoo.moe import Routing
from zoo.moe.experts import SwiGLUExperts
from zoo.moe.factored import FactoredExperts
from zoo_compressors.moe_svd import cholesky_scale, fit_shared
from tiny import tiny_native

CAL = [torch.randint(3, 128, (8, 32), generator=torch.Generator().manual_seed(i)) for i in range(2)]


@pytest.mark.parametrize("num_u", [4, 2])
def test_factored_forward_matches_the_reconstructed_dense_experts(num_u):
    torch.manual_seed(0)
    f = FactoredExperts(4, 32, 48, rank_gate_up=8, rank_down=6, num_u=num_u)
    with torch.no_grad():
        for p in f.parameters():
            p.normal_(0, 0.3)
    dense = SwiGLUExperts(4, 32, 48)
    with torch.no_grad():
        for e in range(4):
            gu, dn = f.dense(e)
            dense.gate_up_proj[e], dense.down_proj[e] = gu, dn
    x = torch.randn(20, 32, requires_grad=True)
    routing = Routing(torch.rand(20, 2), torch.randint(0, 4, (20, 2)))
    out, ref = f(x, routing), dense(x, routing)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-6)
    g, = torch.autograd.grad(out.pow(2).sum(), x)
    g_ref, = torch.autograd.grad(ref.pow(2).sum(), x)
    torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-5)
    assert f.num_parameters() == num_u * (96 * 8 + 32 * 6) + 8 * 32 + 6 * 48


def test_fit_shared_is_exact_at_full_rank_and_shares_v():
    torch.manual_seed(0)
    ws = [torch.randn(12, 6) for _ in range(3)]
    x = torch.randn(100, 6)
    s = cholesky_scale(x.double().T @ x.double())
    u, v, lost = fit_shared(ws, [s] * 3, anchor=1, rank=6)
    for w, ue in zip(ws, u):
        torch.testing.assert_close((ue @ v).float(), w, rtol=1e-4, atol=1e-5)
    assert max(lost) < 1e-8
    u, v, lost = fit_shared(ws, [s] * 3, anchor=1, rank=2)
    assert lost[1] < min(lost[0], lost[2])  # the anchor's own subspace fits it best


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("ratio,u_keep", [(0.75, 1.0), (0.5, 0.5)])
def test_apply_keeps_at_most_ratio_and_roundtrips(family, ratio, u_keep, tmp_path):
    model = zoo.convert(tiny_native(family))
    before = sum(m.experts.num_parameters() for _, m in moe_layers(model))
    zoo.apply(model, "moe-svd", calibration=CAL, ratio=ratio, u_keep=u_keep)
    res = model.config.zoo_recipe[-1]["results"]
    after = sum(m.experts.num_parameters() for _, m in moe_layers(model))
    assert after <= ratio * before + 1 and after < before
    sens = res["sensitivity"]
    worst_chosen = max(sens[str(i)] for i in res["decomposed"])
    assert all(sens[k] >= worst_chosen for k in sens if int(k) not in res["decomposed"])  # least sensitive first
    for i, moe in moe_layers(model):
        if i in res["decomposed"]:
            assert isinstance(moe.experts, FactoredExperts) and moe.experts.num_u == max(1, round(u_keep * moe.num_experts))
    ids = CAL[0][:2]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "m")
    with torch.no_grad():
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()(input_ids=ids).logits
    assert (again - logits).abs().max() < 1e-6


@pytest.mark.parametrize("options", [{"ratio": 0}, {"ratio": 1.5}, {"u_keep": 0}, {"layer_ratio": "x"}])
def test_bad_options_are_rejected_first(options):
    model = zoo.convert(tiny_native("mixtral"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="must be in|must be float"):
        zoo.apply(model, "moe-svd", calibration=CAL, **options)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
