"""ERNIE-4.5-VL and the zoo's per-modality expert blocks (``zoo.moe.modality``): the block against a token-by-token
reference and its refusals, and the tiny ERNIE-4.5-VL converted losslessly (with vision tokens and without), reloaded,
exported back to its own layout and changed by the zoo's components, each modality part a layout entry of its own.

Vision tokens are given as ``moe_mm_token_type_ids`` to the whole model (1 image, 2 video at chosen positions of
plain token ids): they route through the vision experts as the processor's image tokens do; the vision tower itself
is not run (no pixel values), it has no MoE and stays native."""
import pytest
import torch
from transformers import AutoModelForImageTextToText, Ernie4_5_VLMoeForConditionalGeneration

import zoo
from tiny import rel
from tests.families.tiny_configs import tiny_config
from zoo.architectures.family import NotExportable
from zoo.components.registry import registry
from zoo.moe import SharedMLP, SparseMoE, SwiGLUExperts
from zoo.moe.layout import moe_layers, replace_blocks
from zoo.moe.modality import ModalityMoE
from zoo.moe.surgery import keep_experts

H, E = 16, 4
IDS = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(1))
TYPES = torch.zeros_like(IDS)
TYPES[:, 3:7], TYPES[1, 9] = 1, 2  # an image run in both rows, a video token in the second
CAL = [torch.randint(3, 100, (4, 16), generator=torch.Generator().manual_seed(2))]


def part(intermediate):
    router = registry.get("router", "scored-topk").obj(H, E, 2, selection_bias=True)
    moe = SparseMoE(router, SwiGLUExperts(E, H, intermediate))
    with torch.no_grad():
        moe.router.weight.normal_(generator=torch.Generator().manual_seed(intermediate))
    return moe


def test_each_token_goes_through_its_modalitys_part_and_bad_input_is_refused():
    torch.manual_seed(0)
    block = ModalityMoE({"text_moe": part(8), "vision_moe": part(24)}, SharedMLP(H, 8))
    x = torch.randn(2, 6, H, generator=torch.Generator().manual_seed(3))
    types = torch.tensor([[0, 1, 1, 0, 2, 0], [2, 0, 0, 0, 1, 1]])
    text, vision = block.parts()
    want = torch.stack([(text if t == 0 else vision)(x.reshape(-1, H)[n:n + 1])[0]
                        for n, t in enumerate(types.reshape(-1).tolist())]).view(x.shape)
    want = want + block.shared_experts(x)
    assert torch.allclose(block(x, types), want, rtol=1e-5, atol=1e-6)
    everything_text = text(x.reshape(-1, H)).view(x.shape) + block.shared_experts(x)
    for none in (None, torch.zeros_like(types)):
        assert torch.allclose(block(x, none), everything_text, rtol=1e-5, atol=1e-6)
    for bad in (types[:, :5], types.float(), types - 1):
        with pytest.raises(ValueError, match="token types must be non-negative integers, one per token"):
            block(x, bad)
    with pytest.raises(ValueError, match="part names must be identifiers"):
        ModalityMoE({"shared_experts": part(8)})
    with pytest.raises(ValueError, match="parts must map names to SparseMoE blocks"):
        ModalityMoE({"text": SharedMLP(H, 8)})


# ---- the family ---------------------------------------------------------------------------------------------------
def native():
    """The tiny ERNIE-4.5-VL with three layers (dense, sparse, sparse), vision experts twice the text experts' width,
    routers spread and selection biases away from zero, so every part of the routing counts."""
    config = tiny_config("ernie4_5_vl_moe")
    text = config.text_config
    text.num_hidden_layers, text.mlp_layer_types = 3, ["dense", "sparse", "sparse"]
    text.moe_intermediate_size = [32, 64]
    torch.manual_seed(0)
    model = Ernie4_5_VLMoeForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.model.language_model.layers[1:]:
            for name in ("text_moe", "vision_moe"):
                getattr(layer.mlp, name).gate.weight.normal_(generator=gen)
                getattr(layer.mlp, name).gate.moe_statics.e_score_correction_bias.copy_(torch.rand(1, E, generator=gen))
    return model


def logits(model, types=None):
    with torch.no_grad():
        return model(input_ids=IDS, moe_mm_token_type_ids=types, use_cache=False).logits.float()


def greedy(model, types=None):
    with torch.no_grad():
        return model.generate(input_ids=IDS, attention_mask=torch.ones_like(IDS), moe_mm_token_type_ids=types,
                              max_new_tokens=4, do_sample=False, pad_token_id=0)


def vision_rows(model) -> int:
    """Tokens the vision parts' routers see in a forward with vision tokens."""
    seen = []
    hooks = [moe.router.register_forward_hook(lambda m, a, out: seen.append(out.indices.shape[0]))
             for i, moe in moe_layers(model) if i in (3, 6)]
    logits(model, TYPES)
    for h in hooks:
        h.remove()
    return sum(seen)


def test_converts_losslessly_reloads_and_exports_its_own_layout(tmp_path, one_thread):
    model = native()
    want, want_mm = logits(model), logits(model, TYPES)
    tokens, tokens_mm, state = greedy(model), greedy(model, TYPES), dict(model.state_dict())
    model = zoo.convert(model)
    layout = model.config.zoo_layout  # each decoder layer, then a sparse layer's text and vision parts
    assert [e and e["experts_options"]["intermediate_size"] for e in layout] == [None, None, 32, 64, None, 32, 64]
    assert layout[2]["router"] == "scored-topk" and layout[2]["router_options"]["selection_bias"]
    assert vision_rows(model) == 2 * TYPES.count_nonzero().item()
    assert rel(logits(model), want) <= 1e-5 and rel(logits(model, TYPES), want_mm) <= 1e-5
    assert torch.equal(greedy(model), tokens) and torch.equal(greedy(model, TYPES), tokens_mm)

    model.save_pretrained(tmp_path / "zoo")
    back = AutoModelForImageTextToText.from_pretrained(tmp_path / "zoo").eval()
    assert type(back) is type(model) and back.config.zoo_layout == layout
    assert rel(logits(back), want) <= 1e-5 and rel(logits(back, TYPES), want_mm) <= 1e-5

    zoo.export(back, tmp_path / "native")
    again = Ernie4_5_VLMoeForConditionalGeneration.from_pretrained(tmp_path / "native").eval()
    assert type(again) is Ernie4_5_VLMoeForConditionalGeneration
    assert again.state_dict().keys() == state.keys()
    assert all(torch.equal(again.state_dict()[k], v) for k, v in state.items())


def kept(before: SparseMoE, after: SparseMoE) -> set[int]:
    """Which of ``before``'s experts ``after`` kept (their router rows)."""
    return {next(e for e in range(before.num_experts) if torch.equal(row, before.router.weight[e]))
            for row in after.router.weight}


def test_zoo_components_change_every_part_and_it_reloads(tmp_path, one_thread):
    model = zoo.convert(native())
    text = dict(moe_layers(model))[2]
    counts = torch.zeros(E)  # what the first text part routes the calibration tokens to

    def count(module, args, out):  # returns None: the routing goes on unchanged
        counts.add_(out.indices.flatten().bincount(minlength=E).float())

    hook = text.router.register_forward_hook(count)
    with torch.no_grad():
        model(input_ids=CAL[0], use_cache=False)
    hook.remove()
    zoo.apply(model, "prune-frequency", calibration=CAL, num_experts=3)
    assert [moe.num_experts for _, moe in moe_layers(model)] == [3, 3, 3, 3]
    assert kept(text, dict(moe_layers(model))[2]) == set(counts.topk(3).indices.tolist())
    pruned = logits(model, TYPES)
    zoo.export(model, tmp_path / "pruned")  # both modalities at 3 experts: a native config holds them
    again = Ernie4_5_VLMoeForConditionalGeneration.from_pretrained(tmp_path / "pruned").eval()
    assert again.config.text_config.moe_num_experts == 3
    assert rel(logits(again, TYPES), pruned) <= 1e-5

    zoo.apply(model, "expert-choice")
    zoo.apply(model, "quantize", bits=8, group_size=32)
    assert all(moe.router.name == "expert-choice" and moe.experts.name == "quantized" for _, moe in moe_layers(model))
    out = logits(model, TYPES)
    assert torch.isfinite(out).all() and torch.isfinite(logits(model)).all()  # vision parts on no tokens too
    model.save_pretrained(tmp_path / "changed")
    back = AutoModelForImageTextToText.from_pretrained(tmp_path / "changed").eval()
    assert [s["name"] for s in back.config.zoo_recipe] == ["prune-frequency", "expert-choice", "quantize"]
    assert rel(logits(back, TYPES), out) <= 1e-5


def test_parts_may_differ_in_expert_count(tmp_path, one_thread):
    model = zoo.convert(native())
    blocks = dict(moe_layers(model))
    replace_blocks(model, {2: keep_experts(blocks[2], [0, 2, 3]), 3: keep_experts(blocks[3], [1, 2])})
    assert [moe.num_experts for _, moe in moe_layers(model)] == [3, 2, 4, 4]
    out = logits(model, TYPES)
    assert torch.isfinite(out).all()
    model.save_pretrained(tmp_path / "uneven")
    back = AutoModelForImageTextToText.from_pretrained(tmp_path / "uneven").eval()
    assert [e and e["num_experts"] for e in back.config.zoo_layout] == [None, None, 3, 2, None, 4, 4]
    assert rel(logits(back, TYPES), out) <= 1e-5
    with pytest.raises(NotExportable, match=r"layout entry 3: experts_options is"):
        zoo.export(back, tmp_path / "native")
    assert not (tmp_path / "native").exists()


def test_balance_loss_is_the_natives_with_vision_tokens_and_padding():
    """The router logits a balance loss reads are the layer's, one row per token in token order (each from its
    modality's router), as the native block reports them: the same aux loss with a padding mask; after a prune that
    leaves the parts different expert counts it is still defined (the narrower part's columns padded, never picked)."""
    mask = torch.ones_like(IDS)
    mask[0, :3] = 0  # left padding in the first row
    model = native()
    model.config.text_config.router_aux_loss_coef = 0.01
    zoo_model = zoo.convert(native())
    for types in (None, TYPES):
        with torch.no_grad():
            want = model(input_ids=IDS, attention_mask=mask, moe_mm_token_type_ids=types, labels=IDS,
                         output_router_logits=True, use_cache=False)
            got = zoo_model(input_ids=IDS, attention_mask=mask, moe_mm_token_type_ids=types, labels=IDS,
                            output_router_logits=True, use_cache=False)
        assert want.aux_loss is not None and torch.allclose(got.aux_loss, want.aux_loss, rtol=1e-5), types
        assert torch.allclose(got.loss, want.loss, rtol=1e-5)
    for i, moe in moe_layers(zoo_model):
        if moe.num_experts == E and i % 3 == 2:  # one of the two parts of each sparse layer: 4 -> 2 experts
            replace_blocks(zoo_model, {i: keep_experts(moe, torch.tensor([0, 2]))})
    assert len({moe.num_experts for _, moe in moe_layers(zoo_model)}) == 2
    with torch.no_grad():
        out = zoo_model(input_ids=IDS, attention_mask=mask, moe_mm_token_type_ids=TYPES, labels=IDS,
                        output_router_logits=True, use_cache=False)
    assert torch.isfinite(out.aux_loss) and torch.isfinite(out.loss)
