"""Llama 4 multimodal (``llama4``, ``zoo.architectures.llama4_vl``): its language model's MoE blocks convert, and the
zoo model runs a forward of its own, because transformers 5.24's fails on every call. The families test
(``tests/families``) converts, reloads, exports and compresses it on text; here the zoo forward with an image, a
label loss, router logits and tuples, against the native forward's own code (below its decorators, with
``return_dict=False``), and its refusals."""
import inspect

import pytest
import torch
from transformers import Llama4ForConditionalGeneration

import zoo
from tests.families.tiny_configs import tiny_config
from tiny import rel
from zoo.moe.layout import moe_layers

IMAGE = 5  # the image token (the tiny vocabulary has 128 ids; the config's default lies beyond it)
PER_IMAGE = 4  # a 16x16 image in 4x4 patches, pixel-shuffled by 0.5: 4 image tokens
IDS = torch.randint(6, 100, (2, 10), generator=torch.Generator().manual_seed(1))
IDS[:, 2:2 + PER_IMAGE] = IMAGE
PIXELS = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(2))
NATIVE_FORWARD = inspect.unwrap(Llama4ForConditionalGeneration.forward)


def native():
    """The tiny model with a vision tower that runs (its MLP reads the pixel-shuffled patches: 4 x 32 wide)."""
    config = tiny_config("llama4")
    config.image_token_id, config.vision_config.intermediate_size = IMAGE, 128
    torch.manual_seed(0)
    return Llama4ForConditionalGeneration(config).eval()


def reference(model, **inputs):
    """The native forward's code, run past the output bug (``return_dict=False``)."""
    with torch.no_grad():
        return NATIVE_FORWARD(model, use_cache=False, return_dict=False, **inputs)


def test_the_native_forward_fails_in_this_transformers(one_thread):
    """Why the zoo model has a forward of its own: once this fails, transformers' runs, and the zoo's can go."""
    with pytest.raises(AttributeError, match="image_outputs"), torch.no_grad():
        native()(input_ids=IDS, use_cache=False)


def test_an_image_and_a_label_loss_go_through_the_zoo_forward_as_through_the_native_code(one_thread):
    model = native()
    labels = IDS.masked_fill(IDS == IMAGE, -100)
    want_loss, want = reference(model, input_ids=IDS, pixel_values=PIXELS, labels=labels)
    text_only = reference(model, input_ids=IDS)[0]
    assert rel(want, text_only) > 1e-3  # the image changes the logits: the image path is exercised
    model = zoo.convert(model)
    assert moe_layers(model)
    with torch.no_grad():
        out = model(input_ids=IDS, pixel_values=PIXELS, labels=labels, use_cache=False)
        as_tuple = model(input_ids=IDS, pixel_values=PIXELS, use_cache=False, return_dict=False)
    assert rel(out.logits, want) <= 1e-5 and abs(out.loss.item() - want_loss.item()) <= 1e-5
    assert out.image_outputs.last_hidden_state.shape == (2, PER_IMAGE, 32)  # what the native output would carry
    assert isinstance(as_tuple, tuple) and rel(as_tuple[0], want) <= 1e-5
    with torch.no_grad():  # the image features given ready-made: the same
        given = model(input_ids=IDS, mm_encoder_outputs={"image": out.image_outputs}, use_cache=False).logits
    assert rel(given, want) <= 1e-5


def test_generation_with_an_image_picks_the_native_codes_greedy_tokens(one_thread):
    model = native()
    ids = IDS[:1]
    want = ids
    for _ in range(3):  # greedy over the native code, the whole sequence each step
        token = reference(model, input_ids=want, pixel_values=PIXELS[:1])[0][:, -1].argmax(-1, keepdim=True)
        want = torch.cat([want, token], dim=1)
    model = zoo.convert(model)
    with torch.no_grad():
        got = model.generate(input_ids=ids, pixel_values=PIXELS[:1], attention_mask=torch.ones_like(ids),
                             max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(got, want)


def test_router_logits_come_off_the_zoo_routers(one_thread):
    """One [tokens, experts] matrix per MoE layer: the router's weight on the tokens its block reads (the native
    recorder hooked the native router, which the zoo block replaces)."""
    model = zoo.convert(native())
    seen = {}
    hooks = [moe.register_forward_pre_hook(lambda m, args, i=i: seen.__setitem__(i, args[0].flatten(0, -2)))
             for i, moe in moe_layers(model)]
    with torch.no_grad():
        out = model(input_ids=IDS, use_cache=False, output_router_logits=True)
        plain = model(input_ids=IDS, use_cache=False)
    for h in hooks:
        h.remove()
    assert len(out.router_logits) == len(moe_layers(model)) and plain.router_logits is None
    for (i, moe), got in zip(moe_layers(model), out.router_logits):
        assert torch.allclose(got, seen[i] @ moe.router.weight.T, atol=1e-6)


@pytest.mark.parametrize("inputs, match", [
    (dict(input_ids=IDS, inputs_embeds=torch.zeros(2, 10, 32)), "exactly one of input_ids or inputs_embeds"),
    (dict(), "exactly one of input_ids or inputs_embeds"),
    (dict(inputs_embeds=torch.zeros(2, 10, 32), pixel_values=PIXELS), "pixel_values cannot be given"),
    (dict(input_ids=IDS, vision_feature_select_strategy="half"), "Unexpected select feature strategy"),
])
def test_bad_input_is_refused_before_the_model_runs(inputs, match, one_thread):
    model = zoo.convert(native())
    ran = []
    hook = model.language_model.register_forward_pre_hook(lambda *a: ran.append(1))
    with pytest.raises(ValueError, match=match):
        model(**inputs)
    hook.remove()
    assert not ran


def test_zoo_load_takes_a_native_checkpoint(tmp_path, one_thread):
    model = native()
    want = reference(model, input_ids=IDS, pixel_values=PIXELS)[0]
    model.save_pretrained(tmp_path / "native")
    loaded = zoo.load(str(tmp_path / "native"))
    assert type(loaded).__name__ == "ZooLlama4ForConditionalGeneration" and moe_layers(loaded)
    with torch.no_grad():
        assert rel(loaded(input_ids=IDS, pixel_values=PIXELS, use_cache=False).logits, want) <= 1e-5


def test_a_pruned_model_exports_with_its_new_expert_count(tmp_path, one_thread):
    """The native config read back for export holds the pruned count (the block spec is read per block shape)."""
    model = zoo.convert(native())
    zoo.apply(model, "prune-frequency", calibration=[IDS], num_experts=3)
    with torch.no_grad():
        want = model(input_ids=IDS, pixel_values=PIXELS, use_cache=False).logits
    zoo.export(model, tmp_path / "native")
    again = Llama4ForConditionalGeneration.from_pretrained(tmp_path / "native").eval()
    assert again.config.text_config.num_local_experts == 3
    assert rel(reference(again, input_ids=IDS, pixel_values=PIXELS)[0], want) <= 1e-5
