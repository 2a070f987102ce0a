"""Diffusion Gemma: its tiny block-diffusion model (an encoder and a decoder sharing Gemma 4 MoE layers) converted
losslessly with each layer's block held once, by the decoder layer, and run by both stacks; the family's own
denoising generation unchanged; reloaded through its Auto class, exported back to the native layout with the
encoder's tied copies, changed by the zoo's components; untied or diverging stacks and streaming refused."""
import pytest
import torch
from transformers import AutoModelForImageTextToText, DiffusionGemmaForBlockDiffusion

import zoo
from tests.families.test_generic_families import native_model
from tiny import rel
from zoo.architectures.family import NotConvertible
from zoo.editing import stream
from zoo.moe import SparseMoE
from zoo.moe.layout import moe_layers

IDS = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(1))
CANVAS = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(2))  # canvas_length 8
CAL = [torch.randint(3, 100, (4, 16), generator=torch.Generator().manual_seed(3))]
MOE_PARTS = ("router.", "experts.", "feedforward_layernorm_2.")


def native():
    """The tiny model (experts 32 wide), its routers spread so that routing is not a tie."""
    model = native_model("diffusion_gemma")
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for layer in model.model.decoder.layers:  # the encoder's are the same tensors
            layer.router.proj.weight.normal_(generator=gen)
            layer.router.per_expert_scale.uniform_(0.5, 1.5, generator=gen)
    return model


def logits(model):
    """The native forward on a prompt and a given canvas (it draws one at random otherwise)."""
    with torch.no_grad():
        return model(input_ids=IDS, decoder_input_ids=CANVAS).logits


def generated(model):
    torch.manual_seed(5)  # the first canvas is drawn at random
    with torch.no_grad():
        return model.generate(input_ids=IDS[:1], max_new_tokens=8, max_denoising_steps=4).sequences


def test_converts_losslessly_reloads_and_exports_its_own_layout(tmp_path):
    model = native()
    want, want_tokens, want_state = logits(model), generated(model), dict(model.state_dict())
    model = zoo.convert(model)
    encoder, decoder = model.model.encoder.language_model.layers, model.model.decoder.layers
    assert [i for i, _ in moe_layers(model)] == [0, 1] and len(model.config.zoo_layout) == 2
    assert model.config.zoo_layout[0]["router"] == "gemma4-topk"
    for enc, dec in zip(encoder, decoder):  # one block per layer, the decoder's, run by both stacks
        assert isinstance(dec.moe, SparseMoE) and enc.moe_block() is dec.moe
        assert not any(isinstance(m, SparseMoE) or type(m).__name__.endswith("Router") for m in enc.modules())
    assert not [k for k in model.state_dict() if k.startswith("model.encoder.") and ".moe." in k]
    assert encoder[0].self_attn.q_proj.weight is decoder[0].self_attn.q_proj.weight  # the other ties kept
    calls = []
    hook = decoder[0].moe.register_forward_hook(lambda m, a, out: calls.append(a[0].shape[:-1]))
    got = logits(model)
    hook.remove()
    assert calls == [IDS.shape, CANVAS.shape]  # the encoder's call, then the decoder's
    assert rel(got, want) <= 1e-5
    assert torch.equal(generated(model), want_tokens)

    model.save_pretrained(tmp_path / "zoo")
    back = AutoModelForImageTextToText.from_pretrained(tmp_path / "zoo").eval()
    assert type(back) is type(model) and back.config.zoo_layout == model.config.zoo_layout
    assert back.model.encoder.language_model.layers[1].moe_block() is back.model.decoder.layers[1].moe
    assert rel(logits(back), want) <= 1e-5

    zoo.export(back, tmp_path / "native")
    again = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "native").eval()
    state = again.state_dict()
    assert state.keys() == want_state.keys() and all(torch.equal(state[k], v) for k, v in want_state.items())
    enc, dec = again.model.encoder.language_model.layers[0], again.model.decoder.layers[0]
    assert enc.experts.gate_up_proj is dec.experts.gate_up_proj  # tied again, as natively
    assert rel(logits(again), want) <= 1e-5


def test_zoo_components_change_both_stacks_and_it_reloads(tmp_path, one_thread):
    model = zoo.convert(native())
    torch.manual_seed(6)  # the calibration's canvas is drawn at random (the family's forward, given input_ids alone)
    zoo.apply(model, "prune-frequency", calibration=CAL, num_experts=3)
    encoder = model.model.encoder.language_model.layers
    assert all(moe.num_experts == 3 and encoder[i].moe_block() is moe for i, moe in moe_layers(model))
    pruned = logits(model)
    zoo.export(model, tmp_path / "pruned")
    again = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "pruned").eval()
    assert again.config.text_config.num_experts == 3
    assert again.model.encoder.language_model.layers[0].experts.gate_up_proj.shape[0] == 3
    assert rel(logits(again), pruned) <= 1e-5

    zoo.apply(model, "expert-choice")
    zoo.apply(model, "quantize", bits=8, group_size=32)
    assert all((moe.router.name, moe.experts.name) == ("expert-choice", "quantized") and encoder[i].moe_block() is moe
               for i, moe in moe_layers(model))
    out = logits(model)
    assert torch.isfinite(out).all()
    model.save_pretrained(tmp_path / "changed")
    back = AutoModelForImageTextToText.from_pretrained(tmp_path / "changed").eval()
    assert [s["name"] for s in back.config.zoo_recipe] == ["prune-frequency", "expert-choice", "quantize"]
    assert rel(logits(back), out) <= 1e-5


def test_untied_or_diverging_stacks_and_streaming_are_refused_before_anything_changes(tmp_path):
    model = native()
    model.config.tie_word_embeddings = False
    with pytest.raises(NotConvertible, match="tie_word_embeddings=False"):
        zoo.convert(model)
    model.config.tie_word_embeddings = True
    encoder = model.model.encoder.language_model.layers[1]
    encoder.experts.gate_up_proj = torch.nn.Parameter(encoder.experts.gate_up_proj.detach().clone())
    with pytest.raises(NotConvertible, match="layer 1: the encoder's MoE tensors are not the decoder's"):
        zoo.convert(model)
    assert type(model) is DiffusionGemmaForBlockDiffusion
    assert all(hasattr(layer, "router") for layer in model.model.decoder.layers)  # nothing regrouped

    native().save_pretrained(tmp_path / "native")
    with pytest.raises(ValueError, match="run its decoder layers' MoE blocks.*--no-stream"):
        stream.convert(tmp_path / "native", tmp_path / "out")
    assert not (tmp_path / "out").exists()
