"""hodge-cover against independent references: the Hodge decomposition (eigenvectors of L1, known cycles), the
merge barriers (the merged block run in full), the greedy cover on a constructed complex, Wanda pruning (per-row
loops); then the step itself: options, refusals, save and reload."""
import copy
import itertools

import pytest
import torch

import zoo
from zoo.editing.apply import NoChange
from zoo.moe.layout import moe_layers
from zoo.moe.surgery import merge_experts
from zoo_compressors.hodge import boundary_matrices, cliques, edges_below, greedy_cover, hodge_decomposition
from zoo_compressors.hodge_cover import MergeBarriers, hodge_cover_plan
from zoo_compressors.wanda import wanda_prune_experts
from tiny import reload_max_diff, tiny_native

pytestmark = pytest.mark.usefixtures("one_thread")
CAL = [torch.randint(3, 128, (4, 24), generator=torch.Generator().manual_seed(i)) for i in range(2)]


def reference_parts(b1, b2, f):
    """Naive: project onto eigenvectors. ker L1 (harmonic); the range of B1^T B1 (gradient); of B2 B2^T (curl)."""
    def range_projector(a):
        if a.numel() == 0:
            return torch.zeros(f.shape[0], f.shape[0], dtype=torch.float64)
        vals, vecs = torch.linalg.eigh(a)
        v = vecs[:, vals > 1e-9]
        return v @ v.T

    lower, upper = b1.T @ b1, b2 @ b2.T
    vals, vecs = torch.linalg.eigh(lower + upper)
    kernel = vecs[:, vals.abs() < 1e-9]
    return range_projector(lower) @ f, range_projector(upper) @ f, kernel @ kernel.T @ f


@pytest.mark.parametrize("seed", range(4))
def test_hodge_decomposition_matches_the_eigenvector_reference(seed):
    g = torch.Generator().manual_seed(seed)
    n = 7
    edges = [e for e in itertools.combinations(range(n), 2) if torch.rand(1, generator=g) < 0.6]
    triangles = [t for t in cliques(n, edges) if torch.rand(1, generator=g) < 0.5]
    b1, b2 = boundary_matrices(n, edges, triangles)
    assert torch.equal(b1 @ b2, torch.zeros(n, len(triangles), dtype=torch.float64))
    f = torch.rand(len(edges), generator=g, dtype=torch.float64)
    parts = hodge_decomposition(b1, b2, f)
    for got, want in zip(parts, reference_parts(b1, b2, f)):
        assert torch.allclose(got, want, atol=1e-10)
    gradient, curl, harmonic = parts
    assert torch.allclose(gradient + curl + harmonic, f, atol=1e-12)
    for a, b in itertools.combinations(parts, 2):
        assert abs(float(a @ b)) < 1e-10
    laplacian = b1.T @ b1 + b2 @ b2.T
    assert (laplacian @ harmonic).abs().max() < 1e-10


def test_a_hollow_cycle_is_harmonic_and_a_filled_one_is_curl():
    square = [(0, 1), (0, 3), (1, 2), (2, 3)]
    flow = torch.tensor([1.0, -1.0, 1.0, 1.0], dtype=torch.float64)  # 0 -> 1 -> 2 -> 3 -> 0
    gradient, curl, harmonic = hodge_decomposition(*boundary_matrices(4, square, []), flow)
    assert torch.allclose(harmonic, flow) and gradient.abs().max() < 1e-12 and curl.abs().max() < 1e-12
    potential = torch.tensor([0.0, 2.0, 5.0, 1.0], dtype=torch.float64)
    b1, b2 = boundary_matrices(4, square, [])
    gradient, _, harmonic = hodge_decomposition(b1, b2, b1.T @ potential)
    assert torch.allclose(gradient, b1.T @ potential) and harmonic.abs().max() < 1e-12
    triangle = [(0, 1), (0, 2), (1, 2)]
    around = torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64)  # 0 -> 1 -> 2 -> 0
    _, curl, harmonic = hodge_decomposition(*boundary_matrices(3, triangle, [(0, 1, 2)]), around)
    assert torch.allclose(curl, around) and harmonic.abs().max() < 1e-12
    _, curl, harmonic = hodge_decomposition(*boundary_matrices(3, triangle, []), around)
    assert torch.allclose(harmonic, around) and curl.abs().max() < 1e-12


def test_edges_and_cliques_follow_the_threshold():
    b = torch.tensor([[0, 1, 2, 9], [1, 0, 3, 9], [2, 3, 0, 4], [9, 9, 4, 0]], dtype=torch.float64)
    edges = edges_below(b, 3.0)
    assert edges == [(0, 1), (0, 2), (1, 2)]
    assert cliques(4, edges) == [(0, 1, 2)] and cliques(4, edges_below(b, 2.0)) == []


def test_greedy_cover_takes_the_heaviest_uncovered_weight_first():
    edge_weight = {(0, 1): 0.5, (2, 3): 0.3, (1, 2): 0.1}
    # vertex 1 touches 0.6, then 2 or 3 the 0.3 left (2 wins: also more frequent), then frequency decides
    assert greedy_cover(5, 3, edge_weight, {}, [0, 0, 1, 0, 5]) == [1, 2, 4]
    assert greedy_cover(5, 2, {}, {(0, 1, 2): 1.0}, [0, 0, 1, 0, 5]) == [2, 4]  # one vertex covers the triangle


class FakeBarriers:
    """Pairwise barriers for 5 experts: 0, 1, 2 pairwise mergeable, 3 and 4 too, nothing across; the triple
    (0, 1, 2) jointly ``joint``; experts 3 and 4 are routed to most."""

    def __init__(self, joint):
        self.joint = joint
        self.counts = torch.tensor([1.0, 1.0, 1.0, 10.0, 10.0], dtype=torch.float64)

    def __call__(self, members):
        members = set(members)
        if len(members) == 3:
            return self.joint if members == {0, 1, 2} else 2.0
        return 0.1 if members <= {0, 1, 2} or members == {3, 4} else 0.9


def test_the_cover_keeps_a_triple_that_is_pairwise_but_not_jointly_mergeable():
    kept, owner, info = hodge_cover_plan(FakeBarriers(joint=1.0), 5, 3, edge_quantile=0.4)
    assert info["edges"] == 4 and info["cliques"] == 1 and info["triangles"] == 0 and info["betti_1"] == 1
    assert info["energy"]["harmonic"] > 0 and info["retained"]["harmonic"] == 1.0
    assert len(set(kept) & {0, 1, 2}) == 2  # frequency alone would keep 3, 4 and one of the triple
    assert owner[4] == 3 and owner[2] in kept and set(owner.values()) == set(kept)
    # the same triple jointly mergeable: the triangle is filled, no cycle, no excess: frequency decides
    kept, owner, info = hodge_cover_plan(FakeBarriers(joint=0.05), 5, 3, edge_quantile=0.4)
    assert info["triangles"] == 1 and info["betti_1"] == 0 and info["energy"]["harmonic"] < 1e-12
    assert sorted(kept) == [0, 3, 4] and owner[1] == owner[2] == 0


@pytest.fixture(scope="module")
def block():
    model = zoo.convert(tiny_native("mixtral"))
    return moe_layers(model)[0][1]


def test_merge_barriers_match_the_merged_block_run_in_full(block):
    x = torch.randn(96, block.router.hidden_size, generator=torch.Generator().manual_seed(0))
    barriers = MergeBarriers(block, x)
    with torch.no_grad():
        y = block(x)
        for members in [(0, 1), (1, 3), (0, 2, 3)]:
            groups = [list(members)] + [[e] for e in range(block.num_experts) if e not in members]
            weights = [[float(barriers.frequency[m]) for m in g] for g in groups]
            merged = merge_experts(block, groups, weights)(x)
            want = float(((merged - y).double() ** 2).sum() / (y.double() ** 2).sum())
            assert barriers(members) == pytest.approx(want, rel=1e-4)
    counts = torch.zeros(block.num_experts)
    for e in block.route(x).indices.reshape(-1).tolist():
        counts[e] += 1
    assert torch.equal(barriers.counts.float(), counts)


def test_wanda_zeroes_each_rows_lowest_scores(block):
    x = torch.randn(80, block.router.hidden_size, generator=torch.Generator().manual_seed(1))
    new = copy.deepcopy(block)
    zeroed = wanda_prune_experts(new, x, 0.25)
    ex, routing = block.experts, block.route(x)
    expected = 0
    for e in range(block.num_experts):
        rows = torch.stack([x[t] for t in range(len(x)) if e in routing.indices[t].tolist()])
        first = ex.gate_up_proj[e]
        inputs = {"gate_up_proj": rows, "down_proj": ex.glu(rows @ first.T)}
        for name, feats in inputs.items():
            w, got = getattr(ex, name)[e], getattr(new.experts, name)[e]
            norms = torch.sqrt((feats.double() ** 2).sum(0))
            k = int(w.shape[1] * 0.25)
            dropped = torch.zeros(w.shape, dtype=torch.bool)
            dropped.scatter_(1, (w.double().abs() * norms).argsort(dim=1, stable=True)[:, :k], True)
            assert torch.equal(got == 0, dropped) and torch.equal(got[~dropped], w[~dropped])
            expected += k * w.shape[0]
    assert zeroed == expected


@pytest.mark.parametrize("family,options", [("mixtral", {}), ("deepseek_v3", {"reduce": "prune"}),
                                            ("qwen2_moe", {"sparsity": 0.5})])
def test_apply_records_the_cover_and_reloads(family, options, tmp_path):
    model = zoo.convert(tiny_native(family))
    n = moe_layers(model)[0][1].num_experts
    zoo.apply(model, "hodge-cover", calibration=CAL, num_experts=n - 1, **options)
    results = model.config.zoo_recipe[-1]["results"]
    for i, moe in moe_layers(model):
        kept = results["kept"][str(i)]
        assert len(kept) == n - 1 and moe.num_experts == n - 1
        if options.get("reduce") != "prune":
            groups = results["clusters"][str(i)]
            assert [g[0] for g in groups] == kept and sorted(sum(groups, [])) == list(range(n))
            assert moe.router.num_experts == n  # the router keeps its rows behind the expert map
        if options.get("sparsity"):
            assert results["zeroed"][str(i)] == pytest.approx(0.5, abs=0.02)
            w = moe.experts.down_proj
            assert (w == 0).double().mean() == pytest.approx(0.5, abs=0.02)
        info = results["hodge"][str(i)]
        # the parts' shares of the barrier signal's energy (all 0 where every edge's barrier is 0: experts that no
        # calibration token reaches merge at no cost)
        assert sum(info["energy"].values()) in (pytest.approx(1.0, abs=1e-3), 0.0)
    assert reload_max_diff(model, CAL[0], tmp_path / "m") < 1e-5


def test_bad_options_are_refused_before_the_model_changes():
    model = zoo.convert(tiny_native("mixtral"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    n = moe_layers(model)[0][1].num_experts
    for options, match in [({"edge_quantile": 0.0}, "edge_quantile"), ({"edge_quantile": 1.5}, "edge_quantile"),
                           ({"sparsity": 1.0}, "sparsity"), ({"reduce": "drop"}, "reduce must be one of"),
                           ({"num_experts": n + 1}, "num_experts")]:
        with pytest.raises(ValueError, match=match):
            zoo.apply(model, "hodge-cover", calibration=CAL, **{"num_experts": 2, **options})
    with pytest.raises(NoChange):
        zoo.apply(model, "hodge-cover", calibration=CAL, num_experts=n)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
