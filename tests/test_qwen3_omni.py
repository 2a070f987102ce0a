"""Qwen3-Omni: one model holding two MoE decoders (the thinker's text model, the talker) whose blocks route by
rules of their own (the talker's with a sigmoid-gated shared expert), listed in one layout, thinker first. The tiny
omni model is converted losslessly (each decoder's logits, the thinker's greedy tokens), reloaded through
AutoModelForMultimodalLM, exported back to its own layout, and changed by the zoo's components on both decoders."""
import pytest
import torch
from transformers import AutoModelForMultimodalLM, Qwen3OmniMoeForConditionalGeneration

import zoo
from tests.families.tiny_configs import tiny_config
from zoo.architectures.family import NotExportable
from zoo.moe.layout import moe_layers

IDS = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(1))
CAL = [torch.randint(3, 100, (4, 16), generator=torch.Generator().manual_seed(2))]
THINKER_LAYERS = 2  # layout entries 0-1: the thinker's text layers (0 dense); 2-3: the talker's


def native():
    """The tiny omni model, its talker unlike its thinker: wider (64), 6 experts top-3 of another size, a shared
    expert; experts 32 wide or more (the quantizer's groups). Its routers are spread so routing matters, and the
    talker's experts drawn at random (transformers' own init leaves them empty)."""
    config = tiny_config("qwen3_omni_moe")
    config.thinker_config.text_config.moe_intermediate_size = 32
    talker = config.talker_config.text_config
    talker.hidden_size, talker.num_experts, talker.num_experts_per_tok = 64, 6, 3
    talker.moe_intermediate_size, talker.shared_expert_intermediate_size = 64, 32
    torch.manual_seed(0)
    model = Qwen3OmniMoeForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp." in name and ("experts" in name or "gate" in name):
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if name.endswith("gate.weight") else 0.1))
    return model


def logits(model, ids=IDS):
    """(the thinker's logits on ``ids``, the talker's on the same text, projected as it reads a user turn)"""
    with torch.no_grad():
        thinker = model.thinker(input_ids=ids, use_cache=False).logits.float()
        embeds = model.talker.text_projection(model.thinker.get_input_embeddings()(ids))
        return thinker, model.talker(inputs_embeds=embeds, use_cache=False).logits.float()


def greedy(model):
    with torch.no_grad():
        return model.generate(input_ids=IDS, attention_mask=torch.ones_like(IDS), return_audio=False,
                              thinker_max_new_tokens=4, thinker_do_sample=False, thinker_eos_token_id=None)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def close(got, want):
    return all(rel(g, w) <= 1e-5 for g, w in zip(got, want))


def test_converts_losslessly_reloads_and_exports_its_own_layout(tmp_path, one_thread):
    model = native()
    want, want_tokens, want_state = logits(model), greedy(model), dict(model.state_dict())
    model = zoo.convert(model)
    layout = model.config.zoo_layout
    assert layout[0] is None and [i for i, _ in moe_layers(model)] == [1, 2, 3]  # thinker layer 0 is dense
    thinker, talker = layout[1], layout[2]
    assert layout[3] == talker
    # each stack keeps its own rule and shapes: the thinker renormalises its top 2 of 4, the talker takes its top 3
    # of 6 as they are, beside a shared expert under a sigmoid gate, 64 wide
    assert (thinker["num_experts"], thinker["num_experts_per_tok"], thinker["router_options"]["norm_topk_prob"],
            thinker["shared_experts"]) == (4, 2, True, None)
    assert (talker["num_experts"], talker["num_experts_per_tok"], talker["router_options"]["norm_topk_prob"]) == (
        6, 3, False)
    assert talker["shared_experts"] == {"hidden_size": 64, "intermediate_size": 32, "gated": True}
    assert talker["experts_options"]["hidden_size"] == 64 and talker["experts_options"]["intermediate_size"] == 64
    assert close(logits(model), want)
    assert torch.equal(greedy(model), want_tokens)
    assert torch.equal(model.thinker.generate(input_ids=IDS, max_new_tokens=4, do_sample=False, pad_token_id=0),
                       want_tokens)

    model.save_pretrained(tmp_path / "zoo")
    back = AutoModelForMultimodalLM.from_pretrained(tmp_path / "zoo").eval()
    assert type(back) is type(model) and back.config.zoo_layout == layout
    assert close(logits(back), want)

    zoo.export(back, tmp_path / "native")
    again = Qwen3OmniMoeForConditionalGeneration.from_pretrained(tmp_path / "native").eval()
    assert type(again) is Qwen3OmniMoeForConditionalGeneration
    state = again.state_dict()
    assert state.keys() == want_state.keys()
    assert all(torch.equal(state[k], v) for k, v in want_state.items())
    assert close(logits(again), want)


def test_the_zoo_forward_runs_both_decoders_and_refuses_no_text(one_thread):
    model = native()
    want = logits(model)
    model = zoo.convert(model)
    with torch.no_grad():
        out = model(input_ids=IDS, use_cache=False)
    assert close((out.logits, out.talker_logits), want)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="forward reads input_ids"):
        model(inputs_embeds=torch.zeros(1, 3, 32))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def block_inputs(model, ids):
    """Per MoE layer, the tokens a forward of ``ids`` (through both decoders) hands its block."""
    seen = {}
    hooks = [moe.register_forward_pre_hook(lambda m, args, i=i: seen.__setitem__(i, args[0].flatten(0, -2)))
             for i, moe in moe_layers(model)]
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    return seen


def test_zoo_components_change_both_decoders_and_it_reloads(tmp_path, one_thread):
    model = zoo.convert(native())
    routers = {i: (moe.router.weight.clone(), moe.router.top_k) for i, moe in moe_layers(model)}
    zoo.apply(model, "prune-frequency", calibration=CAL, num_experts=3)
    assert [(i, moe.num_experts) for i, moe in moe_layers(model)] == [(1, 3), (2, 3), (3, 3)]
    # each layer kept the 3 experts its tokens picked most, its tokens being those a forward hands it with the layers
    # before pruned (layer by layer, as the engine carries them): the talker's are the text it reads
    for i, x in block_inputs(model, CAL[0]).items():
        weight, k = routers[i]
        counts = torch.bincount((x @ weight.T).topk(k).indices.flatten(), minlength=weight.shape[0])
        assert torch.equal(moe_layers(model)[i - 1][1].router.weight, weight[counts.topk(3).indices.sort().values])
    pruned = logits(model)
    zoo.export(model, tmp_path / "pruned")  # the talker's k = E = 3: renormalising changes nothing
    again = Qwen3OmniMoeForConditionalGeneration.from_pretrained(tmp_path / "pruned").eval()
    assert (again.config.thinker_config.text_config.num_experts, again.config.talker_config.text_config.num_experts) \
        == (3, 3)
    assert close(logits(again), pruned)

    zoo.apply(model, "expert-choice")
    zoo.apply(model, "quantize", bits=8, group_size=32)
    assert all(moe.router.name == "expert-choice" and moe.experts.name == "quantized" for _, moe in moe_layers(model))
    out = logits(model)
    assert all(torch.isfinite(o).all() for o in out)
    model.save_pretrained(tmp_path / "changed")
    back = AutoModelForMultimodalLM.from_pretrained(tmp_path / "changed").eval()
    assert [s["name"] for s in back.config.zoo_recipe] == ["prune-frequency", "expert-choice", "quantize"]
    assert close(logits(back), out)
    with pytest.raises(NotExportable, match="quantized"):
        zoo.export(back, tmp_path / "refused")


def test_export_refuses_a_stack_whose_layers_differ(tmp_path):
    from zoo.moe.surgery import keep_experts
    from zoo.moe.layout import set_block, sync_layout

    model = zoo.convert(native())
    set_block(model, 3, keep_experts(moe_layers(model)[2][1], [0, 1, 2, 3]))  # one talker layer pruned alone
    sync_layout(model)
    with pytest.raises(NotExportable, match=r"layer 3 differs from layer 2 .*one block shape for the talker's"):
        zoo.export(model, tmp_path / "native")
    assert not (tmp_path / "native").exists()
