"""Switch Transformers (encoder-decoder, top-1 routing with expert capacity) in the zoo: converted losslessly with the
MoE layers of both stacks in one layout, reloaded through AutoModelForSeq2SeqLM, exported back to the native class,
its router losses kept, and changed by a router on both stacks."""
import copy

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

import zoo
from zoo.architectures.lookup import NotExportable
from zoo.moe.layout import decoder_layers, layer_prefix, moe_layers

pytestmark = pytest.mark.usefixtures("one_thread")

ENCODER_LAYERS = 3  # all three sparse (step 1); the decoder's two blocks: block 1 sparse (step 2)


def native_model(tie=False, seed=0):
    config = SwitchTransformersConfig(
        vocab_size=64, d_model=32, d_ff=32, d_kv=8, num_heads=4, num_experts=4, expert_capacity=2,
        num_layers=ENCODER_LAYERS, num_decoder_layers=2, num_sparse_encoder_layers=3, num_sparse_decoder_layers=1,
        router_jitter_noise=0.0, dropout_rate=0.0, relative_attention_num_buckets=8,
        relative_attention_max_distance=16, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
        tie_word_embeddings=tie)
    torch.manual_seed(seed)
    return SwitchTransformersForConditionalGeneration(config).eval()


IDS = torch.randint(2, 64, (2, 12), generator=torch.Generator().manual_seed(1))
DECODER_IDS = torch.randint(2, 64, (2, 9), generator=torch.Generator().manual_seed(2))


def logits(model, **extra):
    with torch.no_grad():
        return model(input_ids=IDS, decoder_input_ids=DECODER_IDS, **extra).logits


def greedy(model):
    with torch.no_grad():
        return model.generate(input_ids=IDS, max_new_tokens=4, do_sample=False)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_converts_losslessly_with_both_stacks_in_one_layout():
    native = native_model()
    want, want_tokens = logits(native), greedy(native)
    model = zoo.convert(native)
    assert type(model).__name__ == "ZooSwitchTransformersForConditionalGeneration"
    assert [i for i, _ in moe_layers(model)] == [0, 1, 2, ENCODER_LAYERS + 1]
    assert len(model.config.zoo_layout) == ENCODER_LAYERS + 2
    assert layer_prefix(model, 2) == "encoder.block.2.layer.1." and layer_prefix(model, 4) == "decoder.block.1.layer.2."
    assert all(moe.router.name == "top1-capacity" and moe.experts.name == "mlp" for _, moe in moe_layers(model))
    assert rel(logits(model), want) <= 1e-5
    assert torch.equal(greedy(model), want_tokens) and len(set(want_tokens[:, 1:].flatten().tolist())) > 1
    for _, moe in moe_layers(model):  # capacity drops tokens on these inputs: without it the logits differ
        moe.router.expert_capacity = None
    assert rel(logits(model), want) > 1e-3


def test_router_losses_are_the_familys():
    native = native_model()
    labels = torch.randint(2, 64, DECODER_IDS.shape, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = native(input_ids=IDS, decoder_input_ids=DECODER_IDS, labels=labels, output_router_logits=True)
        got = zoo.convert(native_model())(input_ids=IDS, decoder_input_ids=DECODER_IDS, labels=labels,
                                          output_router_logits=True)
    assert float(want.decoder_aux_loss) > 0  # the decoder's sparse step is 2: the family computes its losses
    for name in ("loss", "encoder_z_loss", "encoder_aux_loss", "decoder_z_loss", "decoder_aux_loss"):
        value, expected = float(getattr(got, name)), float(getattr(want, name))
        assert abs(value - expected) <= 1e-5 * abs(expected), name


@pytest.mark.parametrize("tie", [False, True])
def test_reloads_through_auto_seq2seq_and_exports_to_the_native_class(tie, tmp_path):
    native = native_model(tie=tie)
    want = logits(native)
    model = zoo.convert(native)
    model.save_pretrained(tmp_path / "zoo")
    back = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "zoo").eval()
    assert type(back) is type(model)
    assert back.config.zoo_layout == model.config.zoo_layout
    assert rel(logits(back), want) <= 1e-5
    zoo.export(back, tmp_path / "native")
    again = SwitchTransformersForConditionalGeneration.from_pretrained(tmp_path / "native").eval()
    assert type(again) is SwitchTransformersForConditionalGeneration
    assert again.config.decoder_start_token_id == 0 and again.config.expert_capacity == 2
    assert rel(logits(again), want) <= 1e-5


def test_a_router_changes_both_stacks_and_reloads(tmp_path):
    model = zoo.convert(native_model())
    zoo.apply(model, "expert-choice")
    assert [moe.router.name for _, moe in moe_layers(model)] == ["expert-choice"] * 4
    out = logits(model)
    assert torch.isfinite(out).all()
    with pytest.raises(NotExportable, match="router is 'expert-choice'"):
        zoo.export(model, tmp_path / "native")
    model.save_pretrained(tmp_path / "changed")
    back = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "changed").eval()
    assert [s["name"] for s in back.config.zoo_recipe] == ["expert-choice"]
    assert rel(logits(back), out) <= 1e-5
    labels = torch.randint(2, 64, DECODER_IDS.shape, generator=torch.Generator().manual_seed(3))
    loss = back(input_ids=IDS, decoder_input_ids=DECODER_IDS, labels=labels, output_router_logits=True).loss
    assert torch.isfinite(loss)  # the new routers' logits reach the family's losses


def test_steps_that_cannot_run_refuse_and_leave_the_model_as_it_was():
    model = zoo.convert(native_model())
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="quantizes gated"):  # BitMoD's lookup types: gated experts only
        zoo.apply(model, "quantize", bits=4, group_size=32, dtype="bitmod")
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_calibrated_pruning_runs_both_stacks_in_order():
    """A calibrated compressor on the encoder-decoder, layer by layer in layout order (encoder first): each layer's
    statistics come from the model whose earlier layers, the decoder's included, already hold their pruned blocks,
    the decoder reading the pruned encoder's output (teacher-forced on the calibration text). Checked against that
    procedure written out by hand: route each block's inputs, keep the 3 most used experts, go on."""
    from zoo.moe.layout import put_block
    from zoo.moe.surgery import keep_experts

    model = zoo.apply(zoo.convert(native_model()), "prune-frequency", calibration=[IDS], num_experts=3)
    ref = zoo.convert(native_model())
    for i, block in moe_layers(ref):
        seen = []
        handle = block.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
        with torch.no_grad():
            ref(input_ids=IDS, decoder_input_ids=ref._shift_right(IDS))
        handle.remove()
        x = seen[0].reshape(-1, seen[0].shape[-1])
        with torch.no_grad():
            indices = block.route(x).indices
        counts = torch.bincount(indices[indices < block.num_experts], minlength=block.num_experts)
        keep = sorted(counts.double().argsort(descending=True, stable=True)[:3].tolist())
        layer = next(layer for j, layer in enumerate(decoder_layers(ref)) if j == i)
        put_block(layer, keep_experts(block, keep))
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert [moe.num_experts for _, moe in moe_layers(model)] == [3] * 4


def test_zoo_load_takes_native_and_zoo_folders_through_the_seq2seq_auto_class(tmp_path):
    native = native_model()
    native.save_pretrained(tmp_path / "native")
    model = zoo.load(str(tmp_path / "native"))
    assert type(model) is AutoModelForSeq2SeqLM._model_mapping[type(model.config)]
    assert len(moe_layers(model)) == len(moe_layers(zoo.convert(native_model())))
    torch.testing.assert_close(logits(model), logits(native), rtol=1e-5, atol=1e-6)
    model.save_pretrained(tmp_path / "zoo")
    again = zoo.load(str(tmp_path / "zoo"))
    assert type(again) is type(model)
