"""Per-layer expert budgets (``allocation`` of the expert-count compressors): the split rules against brute force,
the pruned layouts against references built from the unpruned model, streamed = in memory, and bad input refused."""
import copy
import itertools

import pytest
import torch

import zoo
from zoo.editing import stream
from zoo.moe.layout import moe_layers
from zoo_compressors.budgets import error_counts, error_curve, global_counts, search_counts, search_loss
from tiny import folder_tensors, tiny_native
from test_prune import reference_scores

CAL = [torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(i)) for i in range(3)]


def test_global_counts_give_each_layer_its_floor_then_the_best_shares():
    scores = {0: torch.tensor([8.0, 1, 1, 0]), 1: torch.tensor([3.0, 3, 2, 2])}
    # shares: layer 0 .8 .1 .1 0, layer 1 .3 .3 .2 .2; floors 1 each, then .3 .3 .2 .2 .1 .1 ...
    assert global_counts(scores, 4, {0: 1, 1: 1}) == {0: 1, 1: 3}
    assert global_counts(scores, 6, {0: 1, 1: 1}) == {0: 2, 1: 4}
    assert global_counts(scores, 2, {0: 1, 1: 1}) == {0: 1, 1: 1}
    assert global_counts({0: torch.zeros(3), 1: torch.tensor([1.0, 0, 0])}, 3, {0: 1, 1: 1}) == {0: 2, 1: 1}


def test_error_counts_is_the_brute_force_optimum():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        curves = {i: {n: float(torch.rand(1, generator=g)) for n in range(1 + trial % 2, 5)} for i in range(3)}
        total = 7 + trial % 3
        splits = [s for s in itertools.product(*(sorted(c) for c in curves.values())) if sum(s) == total]
        best = min(sum(curves[i][n] for i, n in enumerate(s)) for s in splits)
        got = error_counts(curves, total)
        assert sum(got.values()) == total and sum(curves[i][n] for i, n in got.items()) == pytest.approx(best)
    with pytest.raises(ValueError, match="no split of 20 experts"):
        error_counts({0: {1: 0.0, 2: 0.0}}, 20)


@pytest.mark.parametrize("method,score", [("prune-frequency", "counts"), ("prune-reap", "reap")])
def test_global_allocation_keeps_the_globally_best_shares(method, score, one_thread):
    model = zoo.convert(tiny_native("olmoe"))  # 8 experts, top-2: room to move between the layers
    original = copy.deepcopy(model)
    layers = moe_layers(model)
    n = layers[0][1].num_experts // 2
    zoo.apply(model, method, calibration=CAL, num_experts=n, allocation="global")
    ref = reference_scores(original, CAL)  # the statistics pass sees the unpruned model
    floors = {i: min(moe.top_k, n) for i, moe in layers}
    counts = global_counts({i: ref[i][score] for i in ref}, n * len(layers), floors)
    step = model.config.zoo_recipe[-1]
    assert step["options"] == {"num_experts": n, "allocation": "global"}
    assert step["results"]["experts_per_layer"] == {str(i): c for i, c in counts.items()}
    assert sum(moe.num_experts for _, moe in moe_layers(model)) == n * len(layers)
    assert [moe.num_experts for _, moe in moe_layers(model)] == [counts[i] for i, _ in layers]
    if method == "prune-frequency":  # on this model's routing the shares differ enough to move an expert
        assert len(set(counts.values())) > 1, counts


def test_search_counts_keeps_the_total_and_limits_and_finds_the_brute_force_optimum():
    g = torch.Generator().manual_seed(0)
    floors, caps = {0: 1, 1: 1, 2: 2}, {0: 4, 1: 4, 2: 4}
    for trial in range(5):
        # a loss that does not separate by layer (a product term), as a model's loss does not
        w = torch.rand(3, 5, generator=g).tolist()
        calls = []

        def loss(c):
            calls.append(dict(c))
            return sum(w[i][n] for i, n in c.items()) + w[0][c[0]] * w[1][c[1]] * 3

        splits = [dict(zip(range(3), s)) for s in itertools.product(range(1, 5), range(1, 5), range(2, 5))
                  if sum(s) == 8]
        best = min(map(loss, splits))
        calls.clear()
        counts, got, scored = search_counts(loss, [{0: 3, 1: 3, 2: 2}], floors, caps, generations=20, seed=trial)
        assert got == pytest.approx(best) and loss(counts) == pytest.approx(best)
        assert all(sum(c.values()) == 8 and all(floors[i] <= n <= caps[i] for i, n in c.items()) for c in calls)
        assert len(calls) - 1 == len(scored)  # every split scored once (the check above called it once more)


def test_search_loss_is_the_loss_of_the_pruned_model_and_puts_the_blocks_back(one_thread):
    from zoo.moe.surgery import keep_experts
    from zoo.moe.layout import decoder_layers, put_block

    model = zoo.convert(tiny_native("olmoe"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    orders = {i: list(range(moe.num_experts))[::-1] for i, moe in moe_layers(model)}
    loss = search_loss(model, CAL, orders, tokens=256)
    counts = {i: 3 + k for k, i in enumerate(orders)}
    got = loss(counts)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    pruned = copy.deepcopy(model)
    for i, n in counts.items():
        put_block(decoder_layers(pruned)[i], keep_experts(moe_layers(model)[[j for j, _ in moe_layers(model)].index(i)][1],
                                                            orders[i][:n]))
    with torch.no_grad():  # 256 tokens: two 4 x 32 batches of CAL
        ref = [pruned(input_ids=b, labels=b).loss for b in CAL[:2]]
    assert got == pytest.approx(float(sum(ref) / 2), rel=1e-5)
    assert loss({i: len(o) for i, o in orders.items()}) != pytest.approx(got)


def test_search_allocation_ends_no_worse_than_the_splits_it_starts_from_and_refuses_streaming(tmp_path, one_thread):
    model = zoo.convert(tiny_native("olmoe"))
    n = moe_layers(model)[0][1].num_experts // 2
    zoo.apply(model, "prune-reap", calibration=CAL, num_experts=n, allocation="search")
    results = model.config.zoo_recipe[-1]["results"]
    assert results["search"]["calibration_loss"] <= results["search"]["uniform_loss"]
    assert results["search"]["candidates"] >= 3
    counts = [m.num_experts for _, m in moe_layers(model)]
    assert sum(counts) == n * len(counts)
    assert list(results["experts_per_layer"].values()) == counts
    native = tmp_path / "native"
    tiny_native("olmoe").save_pretrained(native)
    with pytest.raises(ValueError, match="--no-stream"):
        stream.apply(str(native), [("prune-reap", {"num_experts": 4, "allocation": "search"})], tmp_path / "out",
                     calibration=CAL)
    assert not (tmp_path / "out").exists()


def block_inputs(model, batches):
    """Per MoE layer: every calibration token's input to the block [T, H], from the unpruned model."""
    seen = {i: [] for i, _ in moe_layers(model)}
    hooks = [moe.register_forward_hook(lambda m, args, out, i=i: seen[i].append(args[0].reshape(-1, args[0].shape[-1])))
             for i, moe in moe_layers(model)]
    with torch.no_grad():
        for ids in batches:
            model(input_ids=ids)
    for h in hooks:
        h.remove()
    return {i: torch.cat(xs) for i, xs in seen.items()}


def test_error_allocation_is_the_least_error_split_of_the_reference_curves(one_thread):
    model = zoo.convert(tiny_native("deepseek_v3"))
    original = copy.deepcopy(model)
    layers = moe_layers(original)
    n = layers[0][1].num_experts // 2
    zoo.apply(model, "prune-reap", calibration=CAL, num_experts=n, allocation="error")
    results = model.config.zoo_recipe[-1]["results"]
    ref, xs = reference_scores(original, CAL), block_inputs(original, CAL)
    curves = {i: error_curve(moe, xs[i], ref[i]["reap"].double().argsort(descending=True, stable=True).tolist(),
                             min(moe.top_k, n)) for i, moe in layers}
    counts = error_counts(curves, n * len(layers))
    assert results["experts_per_layer"] == {str(i): c for i, c in counts.items()}
    assert len(set(counts.values())) > 1, counts  # this model's layers differ: the split is not the uniform one
    chosen = sum(curves[i][c] for i, c in counts.items())
    assert chosen <= sum(curves[i][n] for i in curves) + 1e-12  # never worse than uniform on its own objective
    assert sum(results["output_error"].values()) == pytest.approx(chosen, rel=1e-4, abs=1e-6)


def test_error_curve_is_zero_at_full_count_and_matches_a_direct_computation(one_thread):
    from zoo.moe.surgery import keep_experts

    model = zoo.convert(tiny_native("mixtral"))
    _, block = moe_layers(model)[0]
    x = torch.randn(40, block.router.hidden_size, generator=torch.Generator().manual_seed(1))
    order = list(range(block.num_experts))[::-1]
    curve = error_curve(block, x, order, 2)
    assert sorted(curve) == list(range(2, block.num_experts + 1)) and curve[block.num_experts] == 0.0
    with torch.no_grad():
        full = block(x).double()
        kept = keep_experts(block, order[:3])(x).double()
    assert curve[3] == pytest.approx(float((kept - full).pow(2).sum() / full.pow(2).sum()), rel=1e-9)
    assert curve[2] >= curve[block.num_experts]


@pytest.mark.parametrize("name,allocation", [("prune-frequency", "global"), ("hc-smoe", "global"),
                                             ("hodge-cover", "error"), ("sub-moe", "global")])
def test_budgets_stream_with_identical_tensors_and_reload(name, allocation, tmp_path, one_thread):
    native = tmp_path / "native"
    tiny_native("olmoe").save_pretrained(native)
    options = {"num_experts": 4, "allocation": allocation}
    model = zoo.apply(zoo.load(native), name, calibration=CAL, **options)
    model.save_pretrained(tmp_path / "memory")
    stream.apply(str(native), [(name, options)], tmp_path / "stream", calibration=CAL)
    a, b = folder_tensors(tmp_path / "memory"), folder_tensors(tmp_path / "stream")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    loaded = zoo.load(tmp_path / "stream")
    ids = CAL[0][:1]
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)
    counts = [m.num_experts for _, m in moe_layers(model)]
    assert [m.num_experts for _, m in moe_layers(loaded)] == counts and sum(counts) == 8 and len(set(counts)) > 1


def test_an_unknown_allocation_is_refused_with_a_suggestion_and_the_model_is_untouched():
    model = zoo.convert(tiny_native("mixtral"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="did you mean 'global'"):
        zoo.apply(model, "prune-frequency", calibration=CAL, num_experts=2, allocation="globl")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_the_card_names_the_split(one_thread):
    from zoo.publishing.cards import card

    model = zoo.apply(zoo.convert(tiny_native("olmoe")), "prune-frequency", calibration=CAL, num_experts=4,
                      allocation="global")
    counts = "/".join(map(str, model.config.zoo_recipe[-1]["results"]["experts_per_layer"].values()))
    assert f'`allocation="global"` (experts per layer: {counts})' in str(card(model))
