"""hc-smoe against an independent reference: mean outputs, clustering, frequency-weighted merge, router rows."""
import copy

import pytest
import torch

import zoo
from zoo.layout import moe_layers
from zoo_compressors.hc_smoe import cluster_experts
from tiny import reload_max_diff, sequential, tiny_native

CAL = [torch.randint(3, 128, (4, 24), generator=torch.Generator().manual_seed(i)) for i in range(2)]


def reference(model):
    """Per layer: each expert's mean output over all tokens, and its routed count (naive loops)."""
    out, handles = {}, []
    for i, moe in moe_layers(model):
        out[i] = {"sum": torch.zeros(moe.num_experts, moe.router.hidden_size, dtype=torch.float64),
                  "count": torch.zeros(moe.num_experts), "tokens": 0}

        def hook(router, args, routing, i=i, moe=moe):
            x = args[0]
            out[i]["tokens"] += x.shape[0]
            for e in range(moe.num_experts):
                for t in range(x.shape[0]):
                    out[i]["sum"][e] += moe.experts.expert(e, x[t:t + 1])[0].double()
            for e in routing.indices.reshape(-1).tolist():
                out[i]["count"][e] += 1
        handles.append(moe.router.register_forward_hook(hook))
    with torch.no_grad():
        for ids in CAL:
            model(input_ids=ids)
    for h in handles:
        h.remove()
    return {i: (v["sum"] / v["tokens"], v["count"]) for i, v in out.items()}


def test_cluster_experts_gives_exactly_n_groups():
    feats = torch.tensor([[0.0], [0.1], [5.0], [5.2], [9.0]])
    groups = cluster_experts(feats, 3)
    assert sorted(map(sorted, groups)) == [[0, 1], [2, 3], [4]]
    assert sorted(sum(cluster_experts(torch.randn(8, 4), 5), [])) == list(range(8))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("router_rows", ["dominant", "average"])
def test_hc_smoe_merges_like_the_reference(family, router_rows, tmp_path):
    model = zoo.convert(tiny_native(family))
    original = copy.deepcopy(model)
    old = {i: {k: v.clone() for k, v in moe.state_dict().items()} for i, moe in moe_layers(model)}
    n = moe_layers(model)[0][1].num_experts // 2
    zoo.apply(model, "hc-smoe", calibration=CAL, num_experts=n, router_rows=router_rows)
    ref = sequential(original, model, reference)  # each layer calibrated behind the merged layers before it
    clusters = model.config.zoo_recipe[-1]["results"]["clusters"]
    for i, moe in moe_layers(model):
        mean, count = ref[i]
        groups = cluster_experts(mean.float(), n)
        assert sorted(map(sorted, groups)) == sorted(map(sorted, clusters[str(i)]))
        assert moe.num_experts == n
        for g, members in enumerate(clusters[str(i)]):
            w = count[members].double() + 1e-9
            w = w / w.sum()
            for name in ("gate_up_proj", "down_proj"):
                expect = (old[i][f"experts.{name}"][members].double() * w.view(-1, 1, 1)).sum(0)
                torch.testing.assert_close(getattr(moe.experts, name)[g].double(), expect, rtol=1e-5, atol=1e-7)
            rows = old[i]["router.weight"][members].double()
            expect_row = rows[int(count[members].argmax())] if router_rows == "dominant" else (rows * w[:, None]).sum(0)
            torch.testing.assert_close(moe.router.weight[g].double(), expect_row, rtol=1e-5, atol=1e-7)
    assert reload_max_diff(model, CAL[0], tmp_path / "m") < 1e-6


def test_hc_smoe_rejects_bad_linkage_before_touching_the_model():
    model = zoo.convert(tiny_native("mixtral"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="linkage must be one of"):
        zoo.apply(model, "hc-smoe", calibration=CAL, num_experts=2, linkage="ward-ish")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_subspace_merge_at_full_rank_is_the_frequency_weighted_average():
    from zoo_compressors.sub_moe import subspace_merge

    ws = [torch.randn(6, 4) for _ in range(3)]
    f = torch.tensor([1.0, 2.0, 5.0])
    avg = sum(w * x for w, x in zip(ws, f / f.sum()))
    torch.testing.assert_close(subspace_merge(ws, f, 1.0).float(), avg, rtol=1e-5, atol=1e-6)
    low = subspace_merge(ws, f, 0.5)  # rank 3 of 6: the average projected on the top-3 shared left subspace
    u = torch.linalg.svd(torch.cat(ws, 1).double(), full_matrices=False)[0][:, :3]
    torch.testing.assert_close(low, u @ u.T @ avg.double(), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_sub_moe_uses_kmeans_clusters_and_roundtrips(family, tmp_path):
    from sklearn.cluster import KMeans

    model = zoo.convert(tiny_native(family))
    original = copy.deepcopy(model)
    n = moe_layers(model)[0][1].num_experts // 2
    zoo.apply(model, "sub-moe", calibration=CAL, num_experts=n, rank_ratio=0.75)
    ref = sequential(original, model, reference)
    clusters = model.config.zoo_recipe[-1]["results"]["clusters"]
    for i, moe in moe_layers(model):
        labels = KMeans(n_clusters=n, n_init=10, random_state=0).fit(ref[i][0].float().numpy()).labels_
        expect = sorted(sorted(int(j) for j in (labels == c).nonzero()[0]) for c in range(n))
        assert sorted(clusters[str(i)]) == expect and moe.num_experts == n
    assert reload_max_diff(model, CAL[0], tmp_path / "m") < 1e-6
