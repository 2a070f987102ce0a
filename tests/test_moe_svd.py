"""moe-svd: factored experts against their reconstructed dense reference; the decomposition itself."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import zoo
from zoo.moe.layout import moe_layers
from zoo.moe import Routing
from zoo.moe.experts import SwiGLUExperts
from zoo.moe.factored import FactoredExperts
from zoo_compressors.moe_svd import cholesky_scale, fit_shared, principal_rank, reconstruction_errors
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
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)  # factored vs reconstructed: other summation order
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


@pytest.mark.parametrize("shape", [(24, 10), (10, 24), (16, 16)])
def test_principal_rank_counts_the_singular_values_holding_the_energy(shape):
    g = torch.Generator().manual_seed(0)
    low = torch.randn(shape[0], 3, generator=g) @ torch.randn(3, shape[1], generator=g)  # rank 3
    for w in (torch.randn(*shape, generator=g), low + 1e-3 * torch.randn(*shape, generator=g)):
        sv2 = torch.linalg.svdvals(w.double()).pow(2)
        for energy in (0.5, 0.9, 0.99):
            want = int((sv2.cumsum(0) / sv2.sum() < energy).sum()) + 1
            assert principal_rank(w, energy) == want / len(sv2), (shape, energy)
    assert principal_rank(low, 0.99) <= 3 / min(shape)


def test_reconstruction_errors_are_the_direct_scaled_errors():
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(12, 6, generator=g) for _ in range(3)]
    scales = [cholesky_scale((x := torch.randn(50, 6, generator=g).double()).T @ x) for _ in range(3)]
    us, v = torch.randn(4, 12, 2, generator=g).double(), torch.randn(2, 6, generator=g).double()
    want = torch.tensor([[float(((w.double() - u @ v) @ s).pow(2).sum()) for u in us] for w, s in zip(ws, scales)],
                        dtype=torch.float64)
    torch.testing.assert_close(reconstruction_errors(ws, scales, us, v), want, rtol=1e-10, atol=1e-10)
    assert reconstruction_errors([], [], us, v).shape == (0, 4)


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


@pytest.mark.parametrize("options", [{"ratio": 0}, {"ratio": 1.5}, {"u_keep": 0}, {"layer_ratio": "x"},
                                     {"sensitivity": "entropy"}])
def test_bad_options_are_rejected_first(options):
    model = zoo.convert(tiny_native("mixtral"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="must be in|must be float|must be one of"):
        zoo.apply(model, "moe-svd", calibration=CAL, **options)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def naive_paper_sensitivity(moe, x):
    """MoE-SVD's S_L = sum_i f_i r_i a_i, token by token and with numpy's SVD."""
    import numpy as np

    from zoo_compressors.moe_svd import ENERGY, OUTLIER

    E, H = moe.num_experts, x.shape[1]
    counts, outliers = [0] * E, [0] * E
    with torch.no_grad():
        chosen = moe.route(x).indices.tolist()
    for t, picks in enumerate(chosen):
        row = x[t].double().abs()
        for e in set(picks):
            counts[e] += 1
            outliers[e] += int((row > OUTLIER * row.mean()).sum())
    total = 0.0
    for e in range(E):
        if not counts[e]:
            continue
        ranks = []
        gate, up = moe.experts.gate_up_proj[e].detach().chunk(2)
        for w in (gate, up, moe.experts.down_proj[e].detach()):
            sv2 = np.linalg.svd(w.double().numpy(), compute_uv=False) ** 2
            share = np.cumsum(sv2) / sv2.sum()
            ranks.append((np.searchsorted(share, ENERGY, side="left") + 1) / len(sv2))
        total += counts[e] / sum(counts) * float(np.mean(ranks)) * outliers[e] / (counts[e] * H)
    return total


def test_paper_sensitivity_matches_the_naive_formula_and_ranks_outlier_layers_higher():
    from zoo_compressors.moe_svd import layer_grams, paper_sensitivity

    model = zoo.convert(tiny_native("mixtral"))
    moe = moe_layers(model)[0][1]
    torch.manual_seed(0)
    x = torch.randn(64, 64)
    x[::3, 5] = 40.0  # planted outlier channel: every third token
    got = paper_sensitivity(moe.experts, layer_grams(moe, x))
    assert got > 0 and got == pytest.approx(naive_paper_sensitivity(moe, x), rel=1e-9)
    calm = paper_sensitivity(moe.experts, layer_grams(moe, torch.randn(64, 64)))
    assert calm < got  # the same layer with no outliers is less sensitive


@pytest.mark.parametrize("sensitivity", ["paper", "energy"])
def test_both_sensitivity_scores_choose_the_least_sensitive_layers(sensitivity):
    model = zoo.convert(tiny_native("qwen3_moe"))
    zoo.apply(model, "moe-svd", calibration=CAL, ratio=0.75, sensitivity=sensitivity)
    res = model.config.zoo_recipe[-1]["results"]
    assert res["sensitivity_score"] == sensitivity and len(res["decomposed"]) >= 1
    sens = res["sensitivity"]
    worst = max(sens[str(i)] for i in res["decomposed"])
    assert all(sens[k] >= worst for k in sens if int(k) not in res["decomposed"])


def test_u_trimming_keeps_the_most_frequent_experts_u_and_duplicate_experts_share_it():
    """u_keep < 1: the U of the most routed experts are kept; an expert identical to a kept one reuses its U
    exactly (trimming loses nothing there)."""
    model = zoo.convert(tiny_native("mixtral"))
    moe = moe_layers(model)[0][1]
    with torch.no_grad():  # experts 2, 3 are copies of 0, 1
        moe.experts.gate_up_proj[2:] = moe.experts.gate_up_proj[:2].clone()
        moe.experts.down_proj[2:] = moe.experts.down_proj[:2].clone()
    zoo.apply(model, "moe-svd", calibration=CAL, ratio=0.9, layer_ratio=0.9, u_keep=0.5)
    f = moe_layers(model)[0][1].experts
    assert isinstance(f, FactoredExperts), type(f).__name__  # layer_ratio 0.9 of 2 layers: both decomposed
    assert f.num_u == 2
    idx = f.u_index.tolist()
    assert idx[0] == idx[2] and idx[1] == idx[3]
