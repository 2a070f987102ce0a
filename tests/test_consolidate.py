"""zoo.consolidate: fine-tunes of one MoE share their similar experts (Imani et al., arXiv:2505.06481).

Fine-tunes here are synthetic: copies of a tiny random Mixtral whose experts get perturbations of chosen sizes
(expert 0 untouched, 1 and 3 nudged, 2 rewritten) and whose non-expert weights move a little."""
import copy

import pytest
import torch
import torch.nn.functional as F

import zoo
from zoo.editing.consolidation import unshare
from zoo.moe.layout import moe_layers
from zoo.moe.experts import SwiGLUExperts
from zoo.moe.pooled import PooledExperts
from zoo.moe.routing import Routing
from zoo.moe.surgery import keep_experts

from tiny import tiny_config, tiny_native

IDS = torch.tensor([[5, 17, 33, 9, 70, 11, 3, 44, 90, 12], [8, 21, 66, 12, 90, 4, 7, 100, 31, 2]])
NUDGE = {1: 0.002, 2: 1.0, 3: 0.004}  # expert -> noise std relative to its weights'; 0 stays bit-identical


@pytest.fixture(scope="module")
def base():
    return zoo.convert(tiny_native("mixtral")).eval()


def finetune_like(base, seed):
    model = copy.deepcopy(base)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" not in name:
                p.add_(1e-3 * torch.randn(p.shape, generator=g))
        for _, moe in moe_layers(model):
            for e, scale in NUDGE.items():
                for t in (moe.experts.gate_up_proj, moe.experts.down_proj):
                    t[e].add_(scale * t[e].std() * torch.randn(t[e].shape, generator=g))
    return model


def cos(a, b, e):
    """The naive similarity of expert e of two experts modules: cosine of all its weights, flattened (in the
    order of the state dict's sorted names, so a threshold equal to it compares equal)."""
    va = torch.cat([a.down_proj[e].flatten(), a.gate_up_proj[e].flatten()]).detach().double()
    vb = torch.cat([b.down_proj[e].flatten(), b.gate_up_proj[e].flatten()]).detach().double()
    return 1.0 if torch.equal(va, vb) else float(F.cosine_similarity(va, vb, dim=0))


def naive_reference(originals, base, threshold, share="anchor"):
    """Copies of the originals whose experts are replaced, one by one, by the copy the rule says serves them."""
    refs = [copy.deepcopy(m) for m in originals]
    with torch.no_grad():
        for j in range(len(moe_layers(refs[0]))):
            olds = [moe_layers(m)[j][1].experts for m in originals]
            news = [moe_layers(m)[j][1].experts for m in refs]
            b = moe_layers(base)[j][1].experts if base is not None else None
            for e in range(olds[0].num_experts):
                if b is not None:
                    near = [i for i, x in enumerate(olds) if cos(x, b, e) >= threshold]
                    groups = [(near, b)] if len(near) > 1 else []
                else:
                    groups, left = [], list(range(len(olds)))
                    while left:
                        lead = left.pop(0)
                        members = [lead] + [i for i in left if cos(olds[lead], olds[i], e) >= threshold]
                        left = [i for i in left if i not in members]
                        groups.append((members, olds[lead]))
                for members, source in groups:
                    for name in ("gate_up_proj", "down_proj"):
                        if share == "mean" and source is not b:
                            value = torch.stack([getattr(olds[i], name)[e] for i in members]).mean(0)
                        else:
                            value = getattr(source, name)[e]
                        for i in members:
                            getattr(news[i], name)[e] = value
    return refs


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_identical_experts_share_one_storage_and_the_bytes_are_saved(base):
    models = [finetune_like(base, 1), finetune_like(base, 2)]
    result = zoo.consolidate(models, threshold=1.0, progress=False)  # only bit-identical experts: expert 0
    assert result.models[0] is models[0] and result.models[1] is models[1]
    blocks = [moe_layers(m) for m in models]
    for (_, a), (_, b) in zip(*blocks):
        assert isinstance(a.experts, PooledExperts) and a.experts.pool is b.experts.pool
        assert a.experts.slots[0] == b.experts.slots[0]
        assert (a.experts.slots[1:] != b.experts.slots[1:]).all()
        pool = a.experts.pool.gate_up_proj
        assert pool[a.experts.slots[0]].data_ptr() == pool[b.experts.slots[0]].data_ptr()
        assert a.experts.pool.num_experts == 2 * 4 - 1
    e = base.config.num_local_experts
    row = (2 * base.config.intermediate_size * 64 + 64 * base.config.intermediate_size) * 4  # fp32 bytes
    index_bytes = sum(moe.experts.table.nbytes for layers in blocks for _, moe in layers)  # [E + 1] int64 each
    assert result.bytes_saved == len(blocks[0]) * row - index_bytes  # one expert per layer stored once, not twice
    assert result.shared_experts == 2 * len(blocks[0])
    assert [g["experts"][0] for g in result.groups] == [[[0, 1]]] * len(blocks[0])
    assert all(len(g["experts"][k]) == 2 for g in result.groups for k in range(1, e))


@pytest.mark.parametrize("with_base,share,threshold", [(False, "anchor", 0.99), (True, "anchor", 0.99),
                                                       (False, "mean", 0.98), (False, "anchor", -1.0)])
def test_outputs_match_the_naive_reference(base, with_base, share, threshold):
    models = [finetune_like(base, s) for s in (1, 2, 3)]
    refs = naive_reference(models, base if with_base else None, threshold, share)
    result = zoo.consolidate(models, threshold=threshold, base=base if with_base else None, share=share,
                             progress=False)
    assert result.shared_experts > 0
    for model, ref in zip(models, refs):
        torch.testing.assert_close(logits(model), logits(ref), rtol=0, atol=1e-5)


def test_threshold_is_inclusive_on_the_similarity(base):
    m1, m2 = finetune_like(base, 1), finetune_like(base, 2)
    s = cos(moe_layers(m1)[0][1].experts, moe_layers(m2)[0][1].experts, 1)
    assert 0.99 < s < 1.0
    result = zoo.consolidate([copy.deepcopy(m1), copy.deepcopy(m2)], threshold=s, progress=False)
    assert result.groups[0]["experts"][1] == [[0, 1]]
    assert result.similarity[0]["experts"][1][0][1] == pytest.approx(s, abs=1e-6)
    above = min(1.0, s + 1e-9)
    result = zoo.consolidate([m1, m2], threshold=above, progress=False)
    assert result.groups[0]["experts"][1] == [[0], [1]]
    assert result.groups[0]["experts"][2] == [[0], [1]]  # the rewritten expert is far below either threshold


def test_base_copy_serves_the_experts_near_the_base(base):
    models = [finetune_like(base, 1), finetune_like(base, 2)]
    result = zoo.consolidate(models, threshold=0.99, base=base, progress=False)
    for j, (_, moe) in enumerate(moe_layers(models[0])):
        b = moe_layers(base)[j][1].experts
        other = moe_layers(models[1])[j][1].experts
        assert torch.equal(moe.experts.pool.gate_up_proj[moe.experts.slots[0]], b.gate_up_proj[0])
        assert torch.equal(moe.experts.pool.down_proj[moe.experts.slots[1]], b.down_proj[1])
        assert moe.experts.slots[1] == other.slots[1]
        assert moe.experts.slots[2] != other.slots[2]  # far from the base: each keeps its own
    assert result.groups[0]["experts"][2] == [[0], [1]]


def test_each_consolidated_model_saves_and_reloads_alone(base, tmp_path):
    from transformers import AutoModelForCausalLM

    models = [finetune_like(base, 1), finetune_like(base, 2)]
    zoo.consolidate(models, threshold=0.99, progress=False)
    for i, model in enumerate(models):
        model.save_pretrained(tmp_path / str(i))
    for i, model in enumerate(models):
        again = AutoModelForCausalLM.from_pretrained(tmp_path / str(i)).eval()
        for _, moe in moe_layers(again):
            assert type(moe.experts) is SwiGLUExperts and moe.experts.num_experts == 4
        assert not any("pool" in k for k in again.state_dict())
        torch.testing.assert_close(logits(again), logits(model), rtol=0, atol=0)


def test_pooled_experts_match_their_reference_with_empty_slots_and_gradients(base):
    models = [finetune_like(base, 1), finetune_like(base, 2)]
    zoo.consolidate(models, threshold=0.99, progress=False)
    experts = moe_layers(models[1])[0][1].experts
    torch.manual_seed(0)
    x = torch.randn(6, 64, requires_grad=True)
    idx = torch.tensor([[0, 3], [1, 4], [2, 0], [4, 4], [3, 1], [2, 2]])  # 4 = empty slot
    w = torch.rand(6, 2)
    out = experts(x, Routing(w, idx))
    ref = experts.reference(x, Routing(w, idx))
    # fp32 summation order differs between the grouped and the per-token path: errors scale with the outputs (up to
    # ~30 here), so the absolute tolerance does too
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=2e-6 * float(ref.abs().max()))
    (g1,) = torch.autograd.grad(out.square().sum(), x)
    (g2,) = torch.autograd.grad(ref.square().sum(), x)
    torch.testing.assert_close(g1, g2, rtol=1e-4, atol=2e-6 * float(g2.abs().max()))


def test_surgery_needs_unshare_which_keeps_the_function(base):
    models = [finetune_like(base, 1), finetune_like(base, 2)]
    zoo.consolidate(models, threshold=0.99, progress=False)
    moe = moe_layers(models[0])[0][1]
    with pytest.raises(ValueError, match="unshare"):
        keep_experts(moe, [0, 1])
    before = logits(models[0])
    unshare(models[0])
    assert all(type(m.experts) is SwiGLUExperts for _, m in moe_layers(models[0]))
    torch.testing.assert_close(logits(models[0]), before, rtol=0, atol=0)
    keep_experts(moe_layers(models[0])[0][1], [0, 1])  # plain experts again: surgery works
    a, b = moe_layers(models[0])[0][1].experts, moe_layers(models[1])[0][1].experts
    assert a.gate_up_proj.data_ptr() != b.pool.gate_up_proj.data_ptr()


def _other_family():
    return zoo.convert(tiny_native("qwen3_moe")).eval()


def _more_experts():
    from transformers import MixtralForCausalLM

    cfg = tiny_config("mixtral")
    cfg.num_local_experts = 6
    torch.manual_seed(0)
    return zoo.convert(MixtralForCausalLM(cfg).eval())


@pytest.mark.parametrize("case,match", [
    ("one", "at least two models"), ("twice", "same model object twice"), ("threshold", "threshold"),
    ("share", "did you mean 'mean'"), ("domains", "did you mean 'code'"), ("family", "one architecture"),
    ("experts", "one architecture"), ("native", "no zoo MoE layers"), ("base_in_models", "only as base"),
    ("domains_count", "one domain per model"), ("mean_with_base", "with a base")])
def test_bad_inputs_fail_in_one_line_and_leave_the_models_bit_identical(base, case, match):
    m1, m2 = finetune_like(base, 1), finetune_like(base, 2)
    kwargs = {"threshold": 0.99, "progress": False}
    models = [m1, m2]
    if case == "one":
        models = [m1]
    elif case == "twice":
        models = [m1, m1]
    elif case == "threshold":
        kwargs["threshold"] = 1.5
    elif case == "share":
        kwargs["share"] = "mena"
    elif case == "domains":
        kwargs["domains"] = ["english", "cod"]
    elif case == "domains_count":
        kwargs["domains"] = ["english"]
    elif case == "family":
        models = [m1, _other_family()]
    elif case == "experts":
        models = [m1, _more_experts()]
    elif case == "native":
        models = [m1, tiny_native("mixtral")]
    elif case == "base_in_models":
        kwargs["base"] = m2
    elif case == "mean_with_base":
        kwargs.update(base=base, share="mean")
    states = [{k: v.clone() for k, v in m.state_dict().items()} for m in models]
    with pytest.raises(ValueError, match=match) as info:
        zoo.consolidate(models, **kwargs)
    assert "\n" not in str(info.value)
    for m, state in zip(models, states):
        assert all(type(moe.experts) is not PooledExperts for _, moe in moe_layers(m))
        after = m.state_dict()
        assert after.keys() == state.keys() and all(torch.equal(after[k], v) for k, v in state.items())
