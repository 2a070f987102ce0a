"""hc-smoe and sub-moe against independent references: mean outputs and output cosine similarity, clustering,
frequency-weighted and subspace merges, the expert map (all router rows kept) and the cut router."""
import copy

import pytest
import torch

import zoo
from zoo.moe.layout import moe_layers
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
                if e < moe.num_experts:  # not an empty slot (a merged layer's two picks of one expert)
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
@pytest.mark.parametrize("router_rows", ["map", "dominant", "average"])
def test_hc_smoe_merges_like_the_reference(family, router_rows, tmp_path):
    model = zoo.convert(tiny_native(family))
    original = copy.deepcopy(model)
    old = {i: {k: v.clone() for k, v in moe.state_dict().items()} for i, moe in moe_layers(model)}
    E = moe_layers(model)[0][1].num_experts
    n = E // 2
    options = {} if router_rows == "map" else {"router": "cut", "router_rows": router_rows}
    zoo.apply(model, "hc-smoe", calibration=CAL, num_experts=n, **options)
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
            if router_rows == "map":  # every router row kept; each member served by its cluster's expert
                assert all(moe.expert_map[m] == g for m in members)
                continue
            rows = old[i]["router.weight"][members].double()
            expect_row = rows[int(count[members].argmax())] if router_rows == "dominant" else (rows * w[:, None]).sum(0)
            torch.testing.assert_close(moe.router.weight[g].double(), expect_row, rtol=1e-5, atol=1e-7)
        if router_rows == "map":
            assert moe.router.num_experts == E and torch.equal(moe.router.weight, old[i]["router.weight"])
        else:
            assert moe.router.num_experts == n and moe.expert_map is None
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


@pytest.mark.parametrize("out_dim,in_dim", [(6, 4), (12, 2), (5, 5)])  # out below, above, at m * in
@pytest.mark.parametrize("rank_ratio", [1.0, 0.96, 0.5, 0.01])
def test_merge_cluster_is_the_svd_merge_with_the_svd_skipped_only_at_the_whole_rank(out_dim, in_dim, rank_ratio,
                                                                                   monkeypatch):
    import zoo_compressors.sub_moe as sub

    ws = [torch.randn(out_dim, in_dim, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    f = torch.tensor([1.0, 2.0, 5.0])
    u, v, r = sub.subspace_parts(ws, f, rank_ratio)  # the reference: the joint SVD at every rank
    full = min(out_dim, 3 * in_dim)
    svds = []
    real = torch.linalg.svd
    monkeypatch.setattr(torch.linalg, "svd", lambda *a, **k: svds.append(1) or real(*a, **k))
    merged, stored = sub.merge_cluster(ws, f, rank_ratio)
    assert bool(svds) == (r < full), (r, full, svds)
    torch.testing.assert_close(merged, u @ v, rtol=1e-9, atol=1e-10)
    assert stored == r * (out_dim + in_dim)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_sub_moe_old_settings_use_euclidean_kmeans_and_roundtrip(family, tmp_path):
    from sklearn.cluster import KMeans

    model = zoo.convert(tiny_native(family))
    original = copy.deepcopy(model)
    n = moe_layers(model)[0][1].num_experts // 2
    zoo.apply(model, "sub-moe", calibration=CAL, num_experts=n, rank_ratio=0.75, clustering="euclidean",
              router="cut")
    ref = sequential(original, model, reference)
    clusters = model.config.zoo_recipe[-1]["results"]["clusters"]
    for i, moe in moe_layers(model):
        labels = KMeans(n_clusters=n, n_init=10, random_state=0).fit(ref[i][0].float().numpy()).labels_
        expect = sorted(sorted(int(j) for j in (labels == c).nonzero()[0]) for c in range(n))
        assert sorted(clusters[str(i)]) == expect and moe.num_experts == n and moe.router.num_experts == n
    assert reload_max_diff(model, CAL[0], tmp_path / "m") < 1e-6


def reference_similarity(model):
    """Per layer: the cosine of two experts' outputs on the same token, averaged over tokens (naive loops)."""
    out, handles = {}, []
    for i, moe in moe_layers(model):
        out[i] = {"sum": torch.zeros(moe.num_experts, moe.num_experts, dtype=torch.float64), "tokens": 0}

        def hook(router, args, routing, i=i, moe=moe):
            x = args[0]
            for t in range(x.shape[0]):
                ys = [moe.experts.expert(e, x[t:t + 1])[0].double() for e in range(moe.num_experts)]
                for a in range(moe.num_experts):
                    for b in range(moe.num_experts):
                        out[i]["sum"][a, b] += torch.dot(ys[a], ys[b]) / (ys[a].norm() * ys[b].norm())
            out[i]["tokens"] += x.shape[0]
        handles.append(moe.router.register_forward_hook(hook))
    with torch.no_grad():
        for ids in CAL:
            model(input_ids=ids)
    for h in handles:
        h.remove()
    return {i: v["sum"] / v["tokens"] for i, v in out.items()}


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_sub_moe_default_clusters_by_output_cosine_at_full_rank(family, tmp_path):
    from sklearn.cluster import KMeans

    model = zoo.convert(tiny_native(family))
    original = copy.deepcopy(model)
    E = moe_layers(model)[0][1].num_experts
    n = E // 2
    zoo.apply(model, "sub-moe", calibration=CAL, num_experts=n)
    ref = sequential(original, model, reference_similarity)
    step = model.config.zoo_recipe[-1]
    for i, moe in moe_layers(model):
        labels = KMeans(n_clusters=n, n_init=10, random_state=0).fit(ref[i].float().numpy()).labels_
        expect = sorted(sorted(int(j) for j in (labels == c).nonzero()[0]) for c in range(n))
        assert sorted(step["results"]["clusters"][str(i)]) == expect
        assert moe.num_experts == n and moe.router.num_experts == E  # the router keeps its rows
        params = step["results"]["parameters"][str(i)]
        assert params["factored_at_rank"] == params["dense"]  # the default keeps the whole rank: nothing truncated
    assert reload_max_diff(model, CAL[0], tmp_path / "m") < 1e-6


def first_layer_merge(model, rank_ratio):
    """sub-moe on ``model``'s first MoE layer, recomputed from its original weights: (clusters, per cluster the
    reference merged (gate_up, down) in float64, the merged model's first block)."""
    from zoo_compressors.sub_moe import subspace_parts

    old = copy.deepcopy(moe_layers(model)[0][1].experts)
    count = reference(model)[moe_layers(model)[0][0]][1]  # the first layer sees the same tokens before and after
    options = {} if rank_ratio is None else {"rank_ratio": rank_ratio}
    merged = zoo.apply(copy.deepcopy(model), "sub-moe", calibration=CAL, num_experts=2, **options)
    clusters = merged.config.zoo_recipe[-1]["results"]["clusters"][str(moe_layers(model)[0][0])]
    freq = count.double() + 1e-9
    expect = []
    for members in clusters:
        pair = []
        for name in ("gate_up_proj", "down_proj"):
            u, v, r = subspace_parts([getattr(old, name)[m] for m in members], freq[members], rank_ratio or 1.0)
            pair.append((u, v, r))
        expect.append(pair)
    return clusters, expect, old, freq, moe_layers(merged)[0][1]


def test_sub_moe_truncated_expert_is_the_dense_product_of_its_factors():
    import torch.nn.functional as F

    model = zoo.convert(tiny_native("mixtral"))
    clusters, expect, old, freq, moe = first_layer_merge(model, 0.5)
    x = torch.randn(5, moe.router.hidden_size, generator=torch.Generator().manual_seed(0))
    for g, ((u1, v1, r1), (u2, v2, r2)) in enumerate(expect):
        assert r1 < min(u1.shape[0], v1.shape[1] * len(clusters[g])) or r1 == 1  # truncated
        torch.testing.assert_close(moe.experts.gate_up_proj[g].double(), u1 @ v1, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(moe.experts.down_proj[g].double(), u2 @ v2, rtol=1e-5, atol=1e-6)
        # the expert's output is the SwiGLU of the factors' product, applied factor by factor
        h = moe.experts.glu(F.linear(F.linear(x.double(), v1), u1).float())
        want = F.linear(F.linear(h.double(), v2), u2)
        torch.testing.assert_close(moe.experts.expert(g, x).double(), want, rtol=1e-4, atol=1e-5)


def test_sub_moe_default_is_plain_averaging_and_truncation_is_not():
    model = zoo.convert(tiny_native("mixtral"))
    clusters, _, old, freq, full = first_layer_merge(model, None)
    clusters_low, _, _, _, low = first_layer_merge(model, 0.5)
    assert clusters == clusters_low  # the first layer sees the same tokens in both: the same clusters
    for g, members in enumerate(clusters):
        w = (freq[members] / freq[members].sum()).view(-1, 1, 1)
        avg = (old.gate_up_proj[members].double() * w).sum(0)
        torch.testing.assert_close(full.experts.gate_up_proj[g].double(), avg, rtol=1e-5, atol=1e-6)
    assert (full.experts.gate_up_proj - low.experts.gate_up_proj).abs().max().item() > 1e-4


# ---- the expert map ---------------------------------------------------------------------------------------------

def mapped_block(E=6, N=3, k=3, H=8, I=5, seed=0, expert_map=(0, 1, 2, 0, 1, 0)):
    from zoo.moe import SparseMoE, SwiGLUExperts
    from zoo_routers.topk_softmax import TopKSoftmax

    g = torch.Generator().manual_seed(seed)
    experts = SwiGLUExperts(N, H, I)
    router = TopKSoftmax(H, E, k)
    with torch.no_grad():
        for p in [*experts.parameters(), *router.parameters()]:
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return SparseMoE(router, experts, expert_map=list(expert_map))


def naive_mapped(block, x):
    """Each token: the router's top-k among its E original experts, each pick run through the merged expert that
    serves it (one at a time), weighted and summed."""
    logits = x @ block.router.weight.T
    probs = logits.softmax(-1)
    w, idx = probs.topk(block.top_k, dim=-1)
    w = w / w.sum(-1, keepdim=True)  # norm_topk_prob
    rows = []
    for t in range(x.shape[0]):
        row = x.new_zeros(x.shape[-1])
        for slot in range(block.top_k):
            merged = block.expert_map[int(idx[t, slot])]
            row = row + w[t, slot] * block.experts.expert(merged, x[t:t + 1])[0]
        rows.append(row)
    return torch.stack(rows)


def test_mapped_block_equals_the_naive_loop_outputs_and_gradients():
    block = mapped_block()
    x = torch.randn(40, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    ref_block = copy.deepcopy(block)
    x2 = x.detach().clone().requires_grad_(True)
    out = block(x[None])[0]
    ref = naive_mapped(ref_block, x2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    # some token picked two originals served by one merged expert (the weights summed into one slot)
    routing = block.route(x.detach())
    assert (routing.indices == block.num_experts).any()
    g = torch.randn_like(out)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(block.named_parameters(), ref_block.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_expert_map_is_checked():
    from zoo.moe import SparseMoE, SwiGLUExperts
    from zoo_routers.topk_softmax import TopKSoftmax

    with pytest.raises(ValueError, match="entries but the router has"):
        SparseMoE(TopKSoftmax(8, 4, 2), SwiGLUExperts(2, 8, 4), expert_map=[0, 1, 0])
    with pytest.raises(ValueError, match="each of the 2 experts"):
        SparseMoE(TopKSoftmax(8, 4, 2), SwiGLUExperts(2, 8, 4), expert_map=[0, 0, 0, 0])


def duplicated(family):
    """A converted tiny model whose experts come in identical pairs (2j and 2j+1), router rows left distinct."""
    model = zoo.convert(tiny_native(family)).eval()
    with torch.no_grad():
        for _, moe in moe_layers(model):
            for p in moe.experts.parameters():
                p[1::2] = p[0::2]
    return model


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("name,options", [("hc-smoe", {}), ("sub-moe", {"rank_ratio": 1.0})])
def test_merging_exact_duplicates_is_lossless(family, name, options, tmp_path):
    model = duplicated(family)
    n = moe_layers(model)[0][1].num_experts // 2
    with torch.no_grad():
        before = model(input_ids=CAL[0]).logits
    merged = zoo.apply(copy.deepcopy(model), name, calibration=CAL, num_experts=n, **options)
    for i, moe in moe_layers(merged):
        assert sorted(map(sorted, merged.config.zoo_recipe[-1]["results"]["clusters"][str(i)])) == \
            [[2 * j, 2 * j + 1] for j in range(n)]
    with torch.no_grad():
        assert (merged(input_ids=CAL[0]).logits - before).abs().max() < 1e-4
    # the zoo's cut router (the old default) loses the router's choice between the two copies' rows
    cut = zoo.apply(copy.deepcopy(model), name, calibration=CAL, num_experts=n, router="cut", **options)
    with torch.no_grad():
        assert (cut(input_ids=CAL[0]).logits - before).abs().max() > 1e-3
    assert reload_max_diff(merged, CAL[0], tmp_path / "m") < 1e-6


def test_expert_map_survives_pruning_merging_and_exports_natively(tmp_path):
    from transformers import AutoModelForCausalLM

    model = zoo.convert(tiny_native("qwen3_moe")).eval()
    zoo.apply(model, "hc-smoe", calibration=CAL, num_experts=4)
    with torch.no_grad():
        logits = model(input_ids=CAL[0]).logits
    zoo.export(model, tmp_path / "native")  # each merged expert written once per router row it serves
    native = AutoModelForCausalLM.from_pretrained(tmp_path / "native").eval()
    assert native.config.num_experts == 8
    with torch.no_grad():
        assert (native(input_ids=CAL[0]).logits - logits).abs().max() < 1e-5
    maps = [moe.expert_map for _, moe in moe_layers(model)]
    zoo.apply(model, "prune-reap", calibration=CAL, num_experts=3)  # the map follows the kept experts
    kept = model.config.zoo_recipe[-1]["results"]["kept"]
    for (i, moe), old in zip(moe_layers(model), maps):
        rows = [e for e, m in enumerate(old) if m in kept[str(i)]]  # the router rows of the kept merged experts
        assert moe.num_experts == 3 and moe.router.num_experts == len(rows)
        expect = [kept[str(i)].index(old[e]) for e in rows]
        assert list(moe.expert_map or range(3)) == expect
    zoo.apply(model, "hc-smoe", calibration=CAL, num_experts=2)  # maps compose
    assert [m.num_experts for _, m in moe_layers(model)] == [2, 2]
    assert reload_max_diff(model, CAL[0], tmp_path / "m") < 1e-6
    with pytest.raises(ValueError, match="router='cut' needs one row per expert"):
        zoo.apply(model, "hc-smoe", calibration=CAL, num_experts=1, router="cut")


def test_a_bad_expert_map_in_a_saved_layout_is_refused(tmp_path):
    import json

    from transformers import AutoModelForCausalLM

    model = zoo.convert(tiny_native("mixtral"))
    zoo.apply(model, "hc-smoe", calibration=CAL, num_experts=2)
    model.save_pretrained(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["zoo_layout"][0]["expert_map"] = [0, 0, 0, 5]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match=r"zoo_layout\[0\]\.expert_map"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "m")


def test_hc_smoe_router_rows_needs_the_cut_router():
    model = zoo.convert(tiny_native("mixtral"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="router_rows chooses the cut router"):
        zoo.apply(model, "hc-smoe", calibration=CAL, num_experts=2, router_rows="average")
    with pytest.raises(ValueError, match="router must be one of"):
        zoo.apply(model, "hc-smoe", calibration=CAL, num_experts=2, router="rows")
    with pytest.raises(ValueError, match="clustering must be one of"):
        zoo.apply(model, "sub-moe", calibration=CAL, num_experts=2, clustering="manhattan")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_streamed_export_of_an_expert_map_says_why_not(tmp_path):
    from zoo.editing import stream
    from zoo.architectures.family import NotExportable

    model = zoo.convert(tiny_native("mixtral"))
    zoo.apply(model, "hc-smoe", calibration=CAL, num_experts=2)
    model.save_pretrained(tmp_path / "m")
    with pytest.raises(NotExportable, match="expert map.*--no-stream"):
        stream.export(tmp_path / "m", tmp_path / "native")
    assert not (tmp_path / "native").exists()
