"""prune-frequency and prune-reap against independent references on tiny Mixtral, Qwen3-MoE, DeepSeek-V3."""
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

import zoo
from zoo.moe.layout import moe_layers
from tiny import sequential, tiny_native

CAL = [torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(i)) for i in range(3)]
FAMILIES = ["mixtral", "qwen3_moe", "deepseek_v3"]


def reference_scores(model, batches):
    """Per layer: routed counts and REAP saliency, computed token by token from the block's own parts."""
    out = {}
    handles = []
    for i, moe in moe_layers(model):
        out[i] = {"counts": torch.zeros(moe.num_experts), "reap_sum": torch.zeros(moe.num_experts, dtype=torch.float64)}

        def hook(router, args, routing, i=i, moe=moe):
            x = args[0]
            for t in range(x.shape[0]):
                for slot in range(routing.indices.shape[1]):
                    e = int(routing.indices[t, slot])
                    y = moe.experts.expert(e, x[t:t + 1])[0].double()
                    out[i]["counts"][e] += 1
                    out[i]["reap_sum"][e] += float(routing.weights[t, slot]) * y.norm()
        handles.append(moe.router.register_forward_hook(hook))
    with torch.no_grad():
        for ids in batches:
            model(input_ids=ids)
    for h in handles:
        h.remove()
    return {i: {"counts": v["counts"], "reap": v["reap_sum"] / v["counts"].clamp(min=1)} for i, v in out.items()}


def top(scores, n):
    return sorted(torch.as_tensor(scores).double().argsort(descending=True, stable=True)[:n].tolist())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method,score", [("prune-frequency", "counts"), ("prune-reap", "reap")])
def test_pruning_keeps_the_reference_choice(family, method, score, tmp_path):
    model = zoo.convert(tiny_native(family))
    original = copy.deepcopy(model)
    before = {i: (moe.router.weight.clone(), moe.experts.gate_up_proj.clone()) for i, moe in moe_layers(model)}
    keep_n = moe_layers(model)[0][1].num_experts // 2
    zoo.apply(model, method, calibration=CAL, num_experts=keep_n)
    # each layer is scored on the tokens the already pruned layers before it produce
    ref = sequential(original, model, lambda m: reference_scores(m, CAL))
    step = model.config.zoo_recipe[-1]
    assert step["name"] == method and step["calibration"]["type"] == "batches"
    for i, moe in moe_layers(model):
        kept = top(ref[i][score], keep_n)
        assert step["results"]["kept"][str(i)] == kept
        assert moe.num_experts == keep_n and moe.router.num_experts == keep_n
        w, gu = before[i]
        assert torch.equal(moe.router.weight, w[kept]) and torch.equal(moe.experts.gate_up_proj, gu[kept])
    # round trip with per-layer structure, then the native format (uniform layout)
    with torch.no_grad():
        ids = CAL[0]
        logits = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    with torch.no_grad():
        assert (loaded(input_ids=ids).logits - logits).abs().max() < 1e-6
    zoo.export(model, tmp_path / "native")
    assert (tmp_path / "native" / "config.json").exists()


def test_survivors_route_as_before_when_their_top_k_is_kept():
    """Pruning removes router rows, nothing else: a token whose top-k experts all survive gets the same
    block output (topk-softmax renormalises over the kept top-k)."""
    model = zoo.convert(tiny_native("qwen3_moe"))
    moe = moe_layers(model)[0][1]
    x = torch.randn(64, moe.router.hidden_size)
    with torch.no_grad():
        full = moe(x[None])[0]
        routing = moe.router(x)
    pruned = zoo.moe.surgery.keep_experts(moe, range(0, moe.num_experts, 2))
    with torch.no_grad():
        out = pruned(x[None])[0]
    kept = set(range(0, moe.num_experts, 2))
    same = torch.tensor([set(r.tolist()) <= kept for r in routing.indices])
    assert same.sum() >= 3 and (~same).sum() >= 3
    torch.testing.assert_close(out[same], full[same], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(out[~same], full[~same])


def test_domain_calibration_changes_what_reap_keeps():
    model = zoo.convert(tiny_native("mixtral"))
    a = zoo.apply(zoo.convert(tiny_native("mixtral")), "prune-reap", calibration=[torch.full((2, 16), 5)],
                  num_experts=2).config.zoo_recipe[-1]["results"]["kept"]
    b = zoo.apply(model, "prune-reap", calibration=[torch.randint(60, 128, (4, 16))], num_experts=2
                  ).config.zoo_recipe[-1]["results"]["kept"]
    assert a != b


@pytest.mark.parametrize("options,message", [
    ({"num_experts": 0}, "positive integer"), ({"num_experts": "two"}, "must be int"),
    ({"num_experts": 9}, "has only 4 experts"), ({"num_expert": 2}, "did you mean 'num_experts'"),
])
def test_bad_options_leave_the_model_untouched(options, message):
    model = zoo.convert(tiny_native("mixtral"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        zoo.apply(model, "prune-frequency", calibration=CAL, **options)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert model.config.zoo_recipe == []
